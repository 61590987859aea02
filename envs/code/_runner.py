"""What both sandbox runners share (standard library only): the request loop, one execution's pipes
and keeper, reading its output, and what its end means.

A runner is started by ``envs/code/sandbox.py`` as ``python -I -S <runner>`` with a scrubbed
environment: ``_zygote.py`` for full isolation, ``_runner_none.py`` for none. One JSON object per
line each way on stdin/stdout:

  runner -> {"ready": true, "isolation": ...}  or  {"ready": false, "error": "what is missing"}
  host -> {"code": ..., "limits": {...}}        runner -> {"stdout", "stderr", "exit_code", "error", "seconds"}

Each execution's first process is its keeper: it reads the code, confines itself (each runner
says how), forks the process that runs the code, and reports that process's wait status. Output
comes back through pipes opened before the fork; the host never opens a path the code could touch.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn, Protocol

from envs.code.limits import Limits

# Imported once by the runner, so every execution starts with them loaded.
PRELOAD = ("math", "cmath", "re", "json", "itertools", "functools", "collections", "heapq", "bisect",
           "string", "random", "fractions", "decimal", "statistics", "typing", "dataclasses", "copy",
           "operator", "datetime", "textwrap", "unicodedata", "array", "enum", "traceback", "io", "time",
           "signal", "socket", "encodings.idna", "ctypes")
CONFINE_FAILED = 126
_OUT_OF_MEMORY, _OUT_OF_MEMORY_TEXT = 137, b"MemoryError: the sandbox's memory limit was reached\n"
ChildFds = tuple[int, int, int, int]
"""The keeper's ends of an execution's pipes: code (read), stdout, stderr, status (write)."""


class Keepers(Protocol):
    """How a runner starts and ends an execution's keeper."""

    def start(self, limits: Limits, fds: ChildFds) -> int:
        """Start a keeper on ``fds`` (the caller closes its copies); its pid."""

    def keeper_ended(self, keeper: int) -> None:
        """The keeper ended: end whatever it left running, so the pipes it handed on close."""

    def end(self, keeper: int) -> int:
        """Kill what is left of the execution, reap it all; the keeper's wait status."""


def send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(isolation: str, keepers: Keepers) -> None:
    """Say ready, then run each request as it comes, until the host closes stdin."""
    send({"ready": True, "isolation": isolation})
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply = run(request["code"], Limits(**request["limits"]), keepers)
        except Exception as err:  # the runner must outlive any one request
            reply = {"stdout": "", "stderr": "", "exit_code": None, "error": f"sandbox failure: {err!r}",
                     "seconds": 0.0}
        send(reply)


def run(code: str, limits: Limits, keepers: Keepers) -> dict:
    """One execution: its pipes, its keeper, its output until it ends or a limit stops it."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    code_r, code_w = os.pipe()
    start = time.monotonic()
    child_fds = (code_r, out_w, err_w, status_w)
    try:
        keeper = keepers.start(limits, child_fds)
    except BaseException:
        for fd in (out_r, err_r, status_r, code_w):
            os.close(fd)
        raise
    finally:
        for fd in child_fds:
            os.close(fd)
    _send_code(code_w, code)
    try:
        out, err, stopped = collect(keeper, out_r, err_r, start + limits.wall_s, limits.output_bytes,
                                    keepers.keeper_ended)
    finally:
        os.close(out_r), os.close(err_r)
        status = _reported_status(status_r, keepers.end(keeper))
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    exit_code, error = _classify(status, stopped, stderr, limits)
    return {"stdout": stdout, "stderr": stderr, "exit_code": exit_code, "error": error,
            "seconds": time.monotonic() - start}


def keep(fds: ChildFds, confine: Callable[[], None]) -> NoReturn:
    """In the keeper: read the code, take stdout and stderr from the pipes, ``confine()``, fork the
    process that runs the code, report its wait status on the status pipe. Never returns."""
    code_r, out_w, err_w, status_w = fds
    try:
        _close_all_but(fds)  # the runner's own, the write end of the code pipe among them
        code = _read_all(code_r)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0), os.dup2(out_w, 1), os.dup2(err_w, 2), os.dup2(status_w, 3)
        os.closerange(4, 2**30)  # a fixed bound: a lowered file limit must not leave one open
        sys.stdin, sys.stdout, sys.stderr = None, os.fdopen(1, "w", buffering=1), os.fdopen(2, "w", buffering=1)
        confine()
        runner = os.fork()
    except BaseException as err:
        with contextlib.suppress(OSError):  # never back into the runner's code, whatever failed
            os.write(2, f"sandbox: could not confine the execution: {str(err)[:300]}\n".encode())
        os._exit(CONFINE_FAILED)
    if runner == 0:
        os.close(3)
        _execute(code)
    os.close(0), os.close(1), os.close(2)
    status = os.waitpid(runner, 0)[1]
    os.write(3, status.to_bytes(4, "little"))
    os._exit(0)


def set_limits(limits: Limits, vm_size: int) -> None:
    """This process's rlimits for an execution; ``vm_size``: the address space it starts with."""
    cpu = max(1, int(limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (vm_size + limits.memory_mb * 2**20,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.disk_mb * 2**20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))


def vm_size(status_fd: int) -> int:
    """VmSize of the process whose /proc/<pid>/status ``status_fd`` is, in bytes."""
    for line in os.pread(status_fd, 8192, 0).decode().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def collect(pid: int, out_r: int, err_r: int, deadline: float, limit: int,
            ended: Callable[[int], None]) -> tuple[bytes, bytes, str | None]:
    """Read both pipes until they close and the keeper ``pid`` has ended, up to ``limit`` bytes each
    and until ``deadline``; call ``ended(pid)`` when it ends, so that the pipes it handed on close."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        # Full isolation: the keeper ran its code and ended before its pid reached us, and its
        # parent, the template, reaped it. Its PID namespace went with it; the pipes close.
        pidfd = None
    buffers = {out_r: bytearray(), err_r: bytearray()}
    open_fds, exited = [out_r, err_r], pidfd is None
    try:
        while open_fds or not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(buffers[out_r]), bytes(buffers[err_r]), "timeout"
            ready, _, _ = select.select(open_fds + ([] if exited else [pidfd]), [], [], remaining)
            for fd in ready:
                if fd == pidfd:
                    exited = True
                    ended(pid)
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.remove(fd)
                buffers[fd] += chunk
                if len(buffers[fd]) > limit:
                    return bytes(buffers[out_r][:limit]), bytes(buffers[err_r][:limit]), "output"
        return bytes(buffers[out_r]), bytes(buffers[err_r]), None
    finally:
        if pidfd is not None:
            os.close(pidfd)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _close_all_but(fds: tuple[int, ...]) -> None:
    low = 0
    for fd in sorted(fds):
        if low < fd:  # os.closerange(n, n) closes everything from n on (close_range(n, ~0))
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 2**30)


def _send_code(fd: int, code: str) -> None:
    try:
        data = code.encode()
        while data:
            data = data[os.write(fd, data):]
    except BrokenPipeError:
        pass  # the keeper died before reading it; its status says why
    finally:
        os.close(fd)


def _read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode()


def _reported_status(status_r: int, keeper_status: int) -> int:
    """The code's wait status as its keeper reported it; the keeper's own when it reported none
    (it was killed: timeout or output limit)."""
    try:
        data = os.read(status_r, 4) if select.select([status_r], [], [], 0)[0] else b""
    finally:
        os.close(status_r)
    return int.from_bytes(data, "little") if len(data) == 4 else keeper_status


def _execute(code: str) -> NoReturn:
    status = 0
    try:
        exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except MemoryError:
        os.write(2, _OUT_OF_MEMORY_TEXT)
        status = _OUT_OF_MEMORY
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def _classify(status: int, stopped: str | None, stderr: str, limits: Limits) -> tuple[int | None, str | None]:
    if stopped == "timeout":
        return None, f"timeout: still running after {limits.wall_s}s"
    if stopped == "output":
        return None, f"output limit ({limits.output_bytes} bytes)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        reason = {signal.SIGXCPU: f"cpu time limit ({limits.cpu_s}s)",
                  signal.SIGXFSZ: f"file size limit ({limits.disk_mb} MB)",
                  signal.SIGKILL: "killed (cpu or memory limit)"}.get(sig, f"killed by signal {sig}")
        return None, reason
    code = os.WEXITSTATUS(status)
    if code == CONFINE_FAILED and "sandbox: could not confine" in stderr:
        return None, "sandbox failure: " + stderr.strip().splitlines()[-1][:400]
    if code == _OUT_OF_MEMORY and stderr.endswith(_OUT_OF_MEMORY_TEXT.decode()):
        return code, f"memory limit ({limits.memory_mb} MB)"
    return code, None
