"""A free TCP port: for a process group's rendezvous, a local cluster's daemons, a test's server."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now ("" for every interface). Another process may take it before it
    is bound again, so a caller that can retry on a clash should."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
