"""Ray's nodes as the run asks about them: one found by its id, and whether it is lost.

Ray declares a node dead only after its missed health checks (about 15 s, and far longer while
the GCS is busy), while an actor's death on it reaches the run within a second or two: a node
whose raylet refuses connections (its process is gone) is lost already.
"""

from __future__ import annotations

import socket

import ray

RAYLET_PROBE_S = 2.0
"""How long a node's raylet is given to take a connection before the node is called lost."""


def find(node_id: str) -> dict:
    """Ray's record of the node (``ray.nodes()``); empty when Ray does not list it (or is not running)."""
    return next((n for n in ray.nodes() if n["NodeID"] == node_id), {}) if ray.is_initialized() else {}


def state(node: dict, timeout_s: float = RAYLET_PROBE_S) -> str:
    """", lost" if Ray has declared ``node`` dead or its raylet refuses connections. A raylet that
    does not answer in time may be lost or only overloaded, and is said so. A node whose raylet
    answers (an actor on it died alone) and one Ray does not list add nothing."""
    if not node:
        return ""
    if not node.get("Alive", True):
        return ", lost"
    try:
        socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return ", lost: its raylet refuses connections"
    except OSError:
        return f", its raylet does not answer within {timeout_s:.0f}s: lost or overloaded"
    return ""


def lost(node_id: str) -> bool:
    """Whether the node is certainly gone, with every process that ran on it."""
    return state(find(node_id)).startswith(", lost")
