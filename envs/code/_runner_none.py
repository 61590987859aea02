"""The sandbox's runner for isolation ``none``: the limits, the pipes and the clean-up, nothing else
(standard library only). For a developer's own machine, chosen explicitly: executed code can read,
write and reach whatever this user can.

    python -I -S _runner_none.py      # started in the folder that holds the executions' own

Each execution's keeper is forked from this process into a new session and a working folder of
its own (removed after it), under rlimits. This process is the subreaper of all it starts, so it
ends and reaps whatever an execution left running.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # -I leaves it out
from envs.code import _runner
from envs.code.limits import Limits

_PR_SET_CHILD_SUBREAPER = 36


class Keepers:
    """Keepers forked from this process (see ``_runner.Keepers``)."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.status_fd = os.open("/proc/self/status", os.O_RDONLY)  # VmSize, read before every fork
        self.folders: dict[int, str] = {}
        if ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:  # orphans come back here
            raise OSError("prctl(PR_SET_CHILD_SUBREAPER) failed")

    def start(self, limits: Limits, fds: _runner.ChildFds) -> int:
        folder = tempfile.mkdtemp(prefix="x", dir=self.workdir)
        vm_size = _runner.vm_size(self.status_fd)
        keeper = os.fork()
        if keeper == 0:
            _runner.keep(fds, lambda: (os.chdir(folder), _runner.set_limits(limits, vm_size)))
        self.folders[keeper] = folder
        return keeper

    def keeper_ended(self, keeper: int) -> None:
        for child in _children():
            if child != keeper:  # its status is still to read
                _runner.kill(child)

    def end(self, keeper: int) -> int:
        _runner.kill(keeper)
        status = os.waitpid(keeper, 0)[1]
        deadline = time.monotonic() + 10
        try:
            while True:  # as subreaper every orphan is ours to reap; a fork bomb may still fork
                self.keeper_ended(keeper)
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError("processes of an execution survived 10 s of SIGKILL")
                    time.sleep(0.001)
        except ChildProcessError:
            return status
        finally:
            shutil.rmtree(self.folders.pop(keeper), ignore_errors=True)  # fd-based: never follows its links


def _children() -> list[int]:
    me, found = str(os.getpid()), []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as stat:
                if name.isdigit() and stat.read().rsplit(")", 1)[1].split()[1] == me:
                    found.append(int(name))
        except (OSError, IndexError):
            pass
    return found


def main() -> None:
    for name in _runner.PRELOAD:
        __import__(name)
    try:
        keepers = Keepers(os.getcwd())
    except OSError as err:
        _runner.send({"ready": False, "error": str(err)})
        os._exit(1)
    _runner.serve("none", keepers)


if __name__ == "__main__":
    main()
