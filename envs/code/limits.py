"""What one sandboxed execution may use (standard library only): the host (``sandbox.py``) sends
them with each request, the runners (``_zygote.py``, ``_runner_none.py``) enforce them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Limits:
    wall_s: float = 10.0
    """Wall clock for the whole execution, every process it started included."""
    cpu_s: float = 5.0
    """CPU seconds of each of its processes (rlimits are per process: the execution as a whole uses
    at most max_processes x cpu_s, and never more than the cores give in wall_s)."""
    memory_mb: int = 512
    """Address space of each of its processes; the execution as a whole maps at most
    max_processes x memory_mb, plus its /tmp (disk_mb). Memory that no rlimit counts (memfd, System
    V IPC, message queues) is refused."""
    output_bytes: int = 64 * 1024
    """Bytes kept from stdout (and stderr); writing more ends the execution."""
    max_processes: int = 8
    """Processes the execution may run at once (with full isolation; counted in the interpreter's
    user namespace)."""
    disk_mb: int = 64
    """Size of the execution's private /tmp (memory-backed), and of any one file it writes."""
    max_files: int = 2048
    """Files and directories the execution may create in its /tmp."""
    max_open_files: int = 64
    """File descriptors the execution may hold at once."""
