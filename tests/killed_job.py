"""A job killed mid-run, as a crash or a preempted node would kill it: the resume tests of the GRPO
and SFT jobs start it in a process of its own and SIGKILL its driver at a chosen point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_until(args: list[str], until, timeout_s: float = 300, script: str = "jobs/grpo.py") -> subprocess.Popen:
    """Start the job in a process of its own and SIGKILL the driver (only it) once ``until()``."""
    proc = subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        while not until():
            assert proc.poll() is None, f"the job ended before it could be killed: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the job did not reach the kill point in time"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        try:  # Ray's own processes share the driver's fate; make sure nothing of it outlives the test
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc
