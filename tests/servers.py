"""Server processes the tests start on loopback (an OpenEnv server, a stand-in for one)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from ray_forge.net import free_port

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def serving(*args: str):
    """A server process on a free loopback port; yields its URL once /health answers."""
    port = free_port()
    # A file, not a pipe: nobody reads a pipe while the test runs, and a full one blocks the server.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, *args, "--port", str(port)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"server {args} did not start:\n{log.read()}")
                time.sleep(0.2)
        yield url, proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()
