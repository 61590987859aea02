"""A local sandbox for model-written Python: one forked process per execution, from a warm pool.

Each execution runs in a fresh child of a pre-started interpreter (``_zygote.py``), so it does not
pay a cold Python start. The child gets its own session and private temporary directory, limits
on CPU time, memory, output size, processes and wall clock, and an environment with no secrets.
As root (containers, CI) it also gets no network (an empty network namespace), a dedicated uid
and a chroot, and every process of that uid is killed when it ends. Without root, an audit hook
refuses sockets, subprocesses, forks and signals instead, which is weaker; see the module
docstring of ``_zygote.py``.
"""

from __future__ import annotations

import json
import os
import queue
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

_ZYGOTE = str(Path(__file__).with_name("_zygote.py"))
# The interpreter's environment: nothing from ours, so no key or token can reach executed code.
_CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
              "PYTHONHASHSEED": "0"}


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    """Bytes kept from stdout (and stderr); writing more ends the execution."""
    max_processes: int = 8
    """Processes the execution may run at once (enforced per uid, so only as root)."""


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


class _Zygote:
    def __init__(self, root: str, uid: int, start_timeout_s: float, isolate: bool) -> None:
        config = json.dumps({"root": root, "uid": uid, "isolate": isolate})
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", _ZYGOTE, config], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_CLEAN_ENV,
                                     cwd=root, text=True, start_new_session=True)
        self.info = self._reply(start_timeout_s)

    def _reply(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            raise SandboxError(f"sandbox interpreter did not answer within {timeout_s:.0f}s")
        return json.loads(line)

    def run(self, code: str, limits: Limits) -> dict:
        self.proc.stdin.write(json.dumps({"code": code, "limits": asdict(limits)}) + "\n")
        self.proc.stdin.flush()
        return self._reply(limits.wall_s + 10)  # the zygote enforces wall_s itself; this is its own bound

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


class LocalSandbox:
    """``sandbox.execute(code) -> ExecResult``; thread-safe, ``size`` executions at once."""

    def __init__(self, size: int = 2, limits: Limits = Limits(), base_uid: int | None = None,
                 start_timeout_s: float = 30.0, isolate: bool = True) -> None:
        """``isolate=False`` skips the root-only measures (uid, chroot, network namespace) even as
        root, leaving the audit-hook fallback; tests use it to exercise that path.

        Each interpreter runs its executions as its own uid, and ending an execution kills every
        process of that uid, so no two sandboxes on a machine may share one: by default the uids
        come from this process's pid."""
        if not 1 <= size <= 16:
            raise ValueError("a sandbox has 1 to 16 interpreters")
        if base_uid is None:
            base_uid = 200_000 + (os.getpid() % 100_000) * 16
        self.limits = limits
        self.root = tempfile.mkdtemp(prefix="ray_forge_sandbox_")
        os.chmod(self.root, 0o711)  # sandbox uids may enter their own directories, not list others
        self.start_timeout_s = start_timeout_s
        self._isolate = isolate
        self._idle: queue.Queue[tuple[int, _Zygote]] = queue.Queue()
        self.uids = [base_uid + i for i in range(size)]
        zygotes = [self._spawn(slot) for slot in range(size)]
        for slot, zygote in enumerate(zygotes):
            self._idle.put((slot, zygote))
        self.isolated = zygotes[0].info["isolated"]
        self.network_namespace = zygotes[0].info["network_namespace"]
        self._closed = False

    def _spawn(self, slot: int) -> _Zygote:
        return _Zygote(self.root, self.uids[slot], self.start_timeout_s, self._isolate)

    def execute(self, code: str, limits: Limits | None = None) -> ExecResult:
        limits = limits or self.limits
        try:
            slot, zygote = self._idle.get(timeout=limits.wall_s + 60)
        except queue.Empty:
            raise SandboxError("no sandbox interpreter became free in time") from None
        try:
            reply = zygote.run(code, limits)
        except (SandboxError, OSError, ValueError) as err:
            # The interpreter died or hung: replace it, and report this execution as failed.
            zygote.kill()
            zygote = self._spawn(slot)
            reply = {"stdout": "", "stderr": "", "exit_code": None, "error": f"sandbox failure: {err}",
                     "seconds": 0.0}
        finally:
            self._idle.put((slot, zygote))
        return ExecResult(**reply)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while not self._idle.empty():
            self._idle.get_nowait()[1].kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LocalSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
