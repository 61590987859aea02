"""The sandbox's runner for full isolation: a warm interpreter that forks one child per execution
(standard library only).

    python -I -S _zygote.py

Before the protocol of ``_runner.py`` starts, one exchange maps the sandbox's user namespace:

  zygote -> {"stage": "map"}   the host writes the uid and gid maps, then -> "mapped"

The process the host started (the launcher) enters new user, mount, network, IPC, UTS and PID
namespaces and forks the zygote, process 1 of the new PID namespace. The zygote forks the template,
builds a read-only root of only what Python needs, and runs a probe execution before it says ready.
For each execution the template forks a keeper into a PID namespace of its own: process 1 there, so
its end ends every process of the execution, and none can see the zygote. The keeper gets its own
mount namespace and size-limited /tmp, rlimits, no capabilities and the seccomp filter. Executions
inherit the template's memory, which never held another execution's code or output.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import signal
import socket
import sys
from dataclasses import asdict
from typing import NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # -I leaves it out
from envs.code import _isolation, _runner, _seccomp, _syscalls
from envs.code.limits import Limits

# The probe runs like any candidate; a full sandbox must show each of these, or it does not start.
_PROBE = """
import ctypes, json, os, socket
seen = {}
try:
    socket.socket()
    seen["socket"] = "allowed"
except PermissionError:
    seen["socket"] = "refused"
seen["mount"] = ctypes.CDLL(None).mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0
seen["proc"] = os.path.exists("/proc/self")
seen["pid"], seen["ppid"] = os.getpid(), os.getppid()
try:
    open("/probe", "w")
    seen["root_writable"] = True
except OSError:
    seen["root_writable"] = False
with open("probe", "w") as f:
    seen["tmp_writable"] = f.write("x") == 1
print(json.dumps(seen))
"""
_PROBE_EXPECTED = {"socket": "refused", "mount": False, "proc": False, "pid": 2, "ppid": 1, "root_writable": False,
                   "tmp_writable": True}
_PROBE_LIMITS = Limits(wall_s=10.0, cpu_s=5.0, memory_mb=256, output_bytes=4096, max_processes=1, disk_mb=1,
                       max_files=16, max_open_files=32)
_SHARING_PROCESSES = 4
"""Processes counted with an execution's in the user namespace: launcher, zygote, template, keeper."""


class Template:
    """The zygote's handle on the template, the process that forks every execution's keeper
    (``_runner.Keepers``). Forked before any request is read, so it never holds one or its output."""

    def __init__(self, sources: list) -> None:
        program = _seccomp.build()
        pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.fork() == 0:
            self.sock.close()
            _serve_as_template(theirs, sources, pid_namespace, program)
        theirs.close()
        os.close(pid_namespace)
        self._receive(5, "the template's start")

    def start(self, limits: Limits, fds: _runner.ChildFds) -> int:
        socket.send_fds(self.sock, [json.dumps(asdict(limits)).encode()], list(fds))
        return int.from_bytes(self._receive(4, "the template's keeper pid"), "little")

    def keeper_ended(self, keeper: int) -> None:
        """Nothing to do: the keeper was process 1 of the execution's PID namespace, so the kernel
        ended every other process of it."""

    def end(self, keeper: int) -> int:
        _runner.kill(keeper)  # ends its whole PID namespace
        return int.from_bytes(self._receive(4, "the keeper's status"), "little")  # the template reaps it

    def _receive(self, size: int, what: str) -> bytes:
        self.sock.settimeout(30)
        data = self.sock.recv(size)
        if len(data) != size:
            raise RuntimeError(f"{what}: the template ended")
        return data


def _serve_as_template(sock: socket.socket, sources: list, pid_namespace: int, program: bytes) -> NoReturn:
    """In the template: for each execution, fork its keeper into a new PID namespace, report the
    keeper's pid, then its wait status. Ends when the zygote does."""
    _isolation.die_with_parent()
    for _, source in sources:
        if isinstance(source, int):
            os.close(source)
    status_fd = os.open("/proc/self/status", os.O_RDONLY)  # its own, before the root changes
    os.close(0), os.close(1)
    sock.send(b"ready")
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 65536, 4)
        if not message:
            os._exit(0)
        limits = Limits(**json.loads(message))
        _isolation.setns(pid_namespace, _isolation.CLONE_NEWPID, "setns back to the zygote's PID namespace")
        _isolation.unshare(_isolation.CLONE_NEWPID, "unshare(CLONE_NEWPID) for the execution")
        vm_size = _runner.vm_size(status_fd)
        keeper = os.fork()
        if keeper == 0:
            _runner.keep(tuple(fds), functools.partial(_confine, limits, vm_size, program))
        for fd in fds:
            os.close(fd)
        sock.send(keeper.to_bytes(4, "little"))
        sock.send(os.waitpid(keeper, 0)[1].to_bytes(4, "little"))


def _confine(limits: Limits, vm_size: int, program: bytes) -> None:
    """In the keeper, before it forks the code's process: its own /tmp, rlimits, no capabilities,
    and the seccomp filter last (the steps before it need calls the filter refuses)."""
    _isolation.private_tmp(limits.disk_mb, limits.max_files)
    _runner.set_limits(limits, vm_size)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes + _SHARING_PROCESSES,) * 2)
    _isolation.drop_capabilities()
    _seccomp.install(program)


def _probe(template: Template) -> None:
    reply = _runner.run(_PROBE, _PROBE_LIMITS, template)
    try:
        seen = json.loads(reply["stdout"])
    except ValueError:
        raise _isolation.IsolationUnavailable(
            f"the isolation probe did not run: {reply['error'] or reply['stderr'][-300:]}") from None
    wrong = {k: seen.get(k) for k, v in _PROBE_EXPECTED.items() if seen.get(k) != v}
    if wrong:
        raise _isolation.IsolationUnavailable(f"the isolation probe found {wrong}, expected "
                                              f"{ {k: _PROBE_EXPECTED[k] for k in wrong} }")


def _read_line(fd: int) -> str:
    """One line from ``fd`` without buffering past it (the next line is the zygote's)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line.decode().strip()


def _launch() -> list:
    """In the launcher: new namespaces, the host's uid/gid maps, then fork the zygote (process 1 of
    the new PID namespace). Returns in the zygote, with the view's sources opened; the launcher
    waits for it and exits with it."""
    if os.geteuid() == 0:
        try:
            os.setgroups([])  # root's groups would otherwise stay with the sandbox's uid
        except PermissionError:
            raise _isolation.IsolationUnavailable(_isolation.ROOT_WITHOUT_CAPS) from None
    _isolation.unshare(_isolation.NAMESPACES, "unshare(CLONE_NEWUSER|NEWNS|NEWNET|NEWIPC|NEWUTS|NEWPID)")
    sources = _isolation.open_sources(_isolation.view_sources())
    _runner.send({"stage": "map"})
    if _read_line(0) != "mapped":
        raise _isolation.IsolationUnavailable("the host did not map the sandbox's user namespace")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)  # now the unprivileged uid the host mapped, with capabilities only in here
    pid = os.fork()
    if pid == 0:
        _isolation.die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # process 1 ignores default-action signals from inside
        return sources
    for fd in (0, 1, 2):  # the host sees the pipes close when the zygote does
        os.close(fd)
    status = os.waitpid(pid, 0)[1]
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def main() -> None:
    for name in _runner.PRELOAD:
        __import__(name)
    try:
        sources = _launch()
        template = Template(sources)  # forked before the root changes: it opens its own /proc/self/status
        _isolation.build_root("/tmp", sources)  # over /tmp of this private mount namespace
        _isolation.undumpable()
        _probe(template)
    except (_isolation.IsolationUnavailable, _seccomp.SeccompError, _syscalls.UnknownArchitecture, OSError) as err:
        _runner.send({"ready": False, "error": str(err)})
        os._exit(1)
    _runner.serve("full", template)


if __name__ == "__main__":
    main()
