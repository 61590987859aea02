"""A local sandbox for model-written Python: one forked process per execution, from a warm pool.

Each execution runs in a fresh child of a pre-started interpreter (``_zygote.py``, or
``_runner_none.py`` for isolation none), so it does not pay a cold Python start. Isolation is
stated, never guessed:

- ``full`` (the default): each interpreter lives in its own user, mount, network, IPC, UTS and PID
  namespaces, mapped to an unprivileged uid outside; it sees a read-only root of only Python's
  installation and the system libraries (no /proc, /sys, /dev/shm, /etc, home or data
  directories); each execution runs in a PID namespace of its own (it cannot see the zygote that
  forks the next one, and its first process's end kills every process it started), with its own
  size-limited /tmp, no capabilities, a seccomp filter (an allowlist of the calls Python needs, on
  x86_64 and aarch64: no sockets, exec, tracing, mounts, new namespaces, keyrings, eBPF, io_uring,
  memfd, System V IPC, file locks), and limits on CPU, memory, processes, open files, disk, output
  and wall clock. It needs no root, only a kernel that allows unprivileged user namespaces; where
  it cannot be had, :class:`LocalSandbox` refuses to start and says what is missing.
- ``none``: the limits only, for a developer's own machine, by explicit choice.

Output comes back through pipes opened before the fork; the host never opens a path the executed
code could have touched, and nothing is cleaned up after it (its /tmp vanishes with it).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from envs.code._isolation import ROOT_WITHOUT_CAPS
from envs.code.limits import Limits

__all__ = ["ExecResult", "Executor", "Limits", "LocalSandbox", "SandboxError", "SandboxUnavailable"]

logger = logging.getLogger(__name__)

# The interpreter each isolation level runs: full isolation's zygote, or the limits-only runner.
_RUNNERS = {"full": str(Path(__file__).with_name("_zygote.py")),
            "none": str(Path(__file__).with_name("_runner_none.py"))}
# The interpreter's environment: nothing from ours, so no key or token can reach executed code.
_CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
              "PYTHONHASHSEED": "0"}
ISOLATION_LEVELS = tuple(_RUNNERS)
_STARTUP_REPLY_BYTES = 64 * 1024
QUEUE_DEPTH = 64
"""Executions that may wait for an interpreter at once (an env actor's turn threads, when its
games call the python tool): how long a wait for a free interpreter may last follows from it."""


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    """Why the execution was stopped or failed in the sandbox ('timeout: ...', 'memory limit ...');
    None when the program ran to its own end (whatever its exit code)."""
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code it ran)."""


class SandboxUnavailable(SandboxError):
    """The sandbox cannot provide the isolation it was configured with; the message says what is missing."""


class _Interpreter:
    """One warm interpreter of the pool: the runner of its isolation level, started in ``workdir``."""

    def __init__(self, isolation: str, ids: tuple[int, int], start_timeout_s: float, workdir: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", _RUNNERS[isolation]], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_CLEAN_ENV,
                                     cwd=workdir, text=True, start_new_session=True)
        try:
            info = self._reply(start_timeout_s)
            if info.get("stage") == "map":
                self._map_ids(*ids)
                info = self._reply(start_timeout_s)
        except SandboxError:
            self.kill()
            raise
        if not info.get("ready"):
            self.kill()
            raise SandboxUnavailable(f"the sandbox cannot provide isolation '{isolation}': {info.get('error')}")
        if info.get("isolation") != isolation:  # never a silent downgrade
            self.kill()
            raise SandboxUnavailable(f"the sandbox started with isolation {info.get('isolation')!r}, "
                                     f"not the {isolation!r} it was asked for")

    def _map_ids(self, uid: int, gid: int) -> None:
        """Map the interpreter's "root" to ``uid``/``gid`` outside (written from here, the parent
        user namespace, which an unprivileged host may do for its own ids)."""
        pid = self.proc.pid
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(text)
        except OSError as err:
            why = " " + ROOT_WITHOUT_CAPS if os.geteuid() == 0 else ""
            raise SandboxUnavailable(f"the sandbox cannot map its user namespace to uid {uid} ({err.strerror} "
                                     f"writing {err.filename}).{why}") from None
        self.proc.stdin.write("mapped\n")
        self.proc.stdin.flush()

    def _reply(self, timeout_s: float, max_chars: int = _STARTUP_REPLY_BYTES) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline(max_chars) if ready else ""
        if not line:
            raise SandboxError(f"sandbox interpreter did not answer within {timeout_s:.0f}s")
        return json.loads(line)

    def run(self, code: str, limits: Limits) -> dict:
        self.proc.stdin.write(json.dumps({"code": code, "limits": asdict(limits)}) + "\n")
        self.proc.stdin.flush()
        # The runner enforces wall_s itself; this is its own bound. A reply holds two outputs of at
        # most output_bytes, each byte at most 6 characters once JSON-escaped.
        return self._reply(limits.wall_s + 10, 12 * limits.output_bytes + _STARTUP_REPLY_BYTES)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)  # with full isolation the launcher and the zygote, whose end ends its namespace
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


class Executor(Protocol):
    """Runs one program and says what came of it: the local sandbox, or Together's interpreter."""

    def execute(self, code: str) -> ExecResult: ...

    def new_session(self) -> None:
        """The next execution starts afresh (a remote interpreter keeps state within a session)."""
        return None


class LocalSandbox(Executor):
    """``sandbox.execute(code) -> ExecResult``; thread-safe, ``size`` executions at once."""

    def __init__(self, size: int = 2, limits: Limits = Limits(), isolation: str = "full",
                 start_timeout_s: float = 30.0, base_uid: int | None = None) -> None:
        """``isolation``: 'full', or 'none' to run with limits only (a developer's own machine).

        As root each interpreter's namespace maps to its own unprivileged uid, by default derived
        from this process's pid so that two sandboxes on a machine never share one; otherwise to
        this user's uid."""
        if not 1 <= size <= 16:
            raise ValueError("a sandbox has 1 to 16 interpreters")
        if isolation not in ISOLATION_LEVELS:
            raise ValueError(f"sandbox isolation must be one of {ISOLATION_LEVELS}, got {isolation!r}")
        if base_uid is None:
            base_uid = 200_000 + (os.getpid() % 100_000) * 16
        self.limits, self.isolation, self.start_timeout_s = limits, isolation, start_timeout_s
        # Executions' own folders with isolation 'none' (full isolation gives each its own /tmp).
        self.workdir = tempfile.mkdtemp(prefix="ray_forge_sandbox_") if isolation == "none" else "/"
        root_host = os.geteuid() == 0
        self._ids = [(base_uid + i, base_uid + i) if root_host else (os.geteuid(), os.getegid()) for i in range(size)]
        if isolation == "none":
            logger.warning("code sandbox with isolation 'none': executed code can read, write and reach "
                           "whatever this user can. Use it only on your own machine.")
        self._idle: queue.Queue[tuple[int, _Interpreter]] = queue.Queue()
        self._closed = False
        try:
            for slot in range(size):
                self._idle.put((slot, self._spawn(slot)))
        except BaseException:
            self.close()
            raise

    def _spawn(self, slot: int) -> _Interpreter:
        return _Interpreter(self.isolation, self._ids[slot], self.start_timeout_s, self.workdir)

    @property
    def pids(self) -> list[int]:
        """The interpreters' launcher processes (each with its zygote and executions below it)."""
        return [interpreter.proc.pid for _, interpreter in list(self._idle.queue)]

    def execute(self, code: str, limits: Limits | None = None) -> ExecResult:
        limits = limits or self.limits
        try:
            # At most QUEUE_DEPTH executions wait for an interpreter, each ahead using its whole wall clock.
            slot, interpreter = self._idle.get(timeout=(limits.wall_s + 10) * -(-QUEUE_DEPTH // len(self._ids)) + 60)
        except queue.Empty:
            raise SandboxError("no sandbox interpreter became free in time") from None
        try:
            reply = interpreter.run(code, limits)
        except (SandboxError, OSError, ValueError) as err:
            # The interpreter died or hung: replace it, and report this execution as failed.
            interpreter.kill()
            interpreter = self._spawn(slot)
            reply = {"stdout": "", "stderr": "", "exit_code": None, "error": f"sandbox failure: {err}",
                     "seconds": 0.0}
        finally:
            self._idle.put((slot, interpreter))
        return ExecResult(**reply)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while not self._idle.empty():
            self._idle.get_nowait()[1].kill()
        if self.isolation == "none":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
