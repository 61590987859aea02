"""The sandbox's warm interpreter: forks one child per execution (standard library only).

Run by ``envs/code/sandbox.py`` as ``python -I -S _zygote.py <config json>`` with a scrubbed
environment. One JSON object per line each way on stdin/stdout:

  (full isolation)  zygote -> {"stage": "map"}   host writes the uid and gid maps, then -> "mapped"
  zygote -> {"ready": true, "isolation": ...}  or  {"ready": false, "error": "what is missing"}
  host -> {"code": ..., "limits": {...}}        zygote -> {"stdout", "stderr", "exit_code", "error", "seconds"}

With ``isolation: full`` the process the host started (the launcher) enters new user, mount,
network, IPC, UTS and PID namespaces and forks the zygote, which is process 1 of the new PID
namespace, builds a read-only root of only what Python needs, and checks the result with a probe
execution before it says ready. Each execution is a child of the zygote with its own mount
namespace and size-limited /tmp, rlimits, no capabilities and a seccomp filter; its output comes
back through pipes opened before the fork; when it ends, the zygote kills every other process of
the namespace. With ``isolation: none`` (a developer's machine only) just the rlimits, the pipes and
the clean-up apply.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's folder out
import _isolation  # noqa: E402
import _seccomp  # noqa: E402

# Imported once here, so every execution starts with them loaded.
PRELOAD = ("math", "cmath", "re", "json", "itertools", "functools", "collections", "heapq", "bisect",
           "string", "random", "fractions", "decimal", "statistics", "typing", "dataclasses", "copy",
           "operator", "datetime", "textwrap", "unicodedata", "array", "enum", "traceback", "io", "time",
           "signal", "socket", "encodings.idna", "ctypes")
_PR_SET_CHILD_SUBREAPER = 36
_CONFINE_FAILED = 126
_OUT_OF_MEMORY, _OUT_OF_MEMORY_TEXT = 137, b"MemoryError: the sandbox's memory limit was reached\n"
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


def _send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _read_line(fd: int) -> str:
    """One line from ``fd`` without buffering past it (the next line is the zygote's)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line.decode().strip()


class Zygote:
    def __init__(self, config: dict, sources: list | None) -> None:
        self.full = config["isolation"] == "full"
        self.workdir = config["workdir"]
        if self.full:  # the template forks executions: it keeps the filter and its own VmSize
            self.filter = _seccomp.build()
            self.pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY)
            self.template = self._start_template(sources)
            _isolation.build_root("/tmp", sources)  # over /tmp of this private mount namespace
            _isolation.undumpable()
        else:
            self.status_fd = os.open("/proc/self/status", os.O_RDONLY)  # VmSize, read before every fork
            import ctypes

            ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans come back here to be ended

    def probe(self) -> None:
        limits = {"wall_s": 10.0, "cpu_s": 5.0, "memory_mb": 256, "output_bytes": 4096, "max_processes": 1,
                  "disk_mb": 1, "max_files": 16, "max_open_files": 32}
        reply = self.run({"code": _PROBE, "limits": limits})
        try:
            seen = json.loads(reply["stdout"])
        except ValueError:
            raise _isolation.IsolationUnavailable(
                f"the isolation probe did not run: {reply['error'] or reply['stderr'][-300:]}") from None
        wrong = {k: seen.get(k) for k, v in _PROBE_EXPECTED.items() if seen.get(k) != v}
        if wrong:
            raise _isolation.IsolationUnavailable(f"the isolation probe found {wrong}, expected "
                                                  f"{ {k: _PROBE_EXPECTED[k] for k in wrong} }")

    def _vm_size(self) -> int:
        for line in os.pread(self.status_fd, 8192, 0).decode().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmSize in /proc/self/status")

    def run(self, request: dict) -> dict:
        limits = request["limits"]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        code_r, code_w = os.pipe()
        workdir = None if self.full else tempfile.mkdtemp(prefix="x", dir=self.workdir)
        start = time.monotonic()
        child_fds = (code_r, out_w, err_w, status_w)
        if self.full:  # forked by the template, which never held a request or an output
            socket.send_fds(self.template, [json.dumps(limits).encode()], list(child_fds))
        else:
            keeper = os.fork()
            if keeper == 0:
                os.close(out_r), os.close(err_r), os.close(status_r), os.close(code_w)
                self._keeper(limits, child_fds, self._vm_size(), workdir)
        for fd in child_fds:
            os.close(fd)
        _send_code(code_w, request["code"])
        if self.full:
            keeper = int.from_bytes(_receive(self.template, 4, "the template's keeper pid"), "little")
        try:
            out, err, stopped = self._collect(keeper, out_r, err_r, start + limits["wall_s"], limits["output_bytes"])
        finally:
            os.close(out_r), os.close(err_r)
            status = self._end(keeper)
            status = _reported_status(status_r, status)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)  # fd-based: never follows the child's links
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        exit_code, error = _classify(status, stopped, stderr, limits)
        return {"stdout": stdout, "stderr": stderr, "exit_code": exit_code, "error": error,
                "seconds": time.monotonic() - start}

    def _start_template(self, sources: list) -> socket.socket:
        """Fork the process that forks every execution, before any request is read: executions
        inherit its memory, which never holds another execution's code or output."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.fork() == 0:
            ours.close()
            _isolation.die_with_parent()
            for _, source in sources:
                if isinstance(source, int):
                    os.close(source)
            self.status_fd = os.open("/proc/self/status", os.O_RDONLY)  # its own, before the root changes
            os.close(0), os.close(1)
            theirs.send(b"ready")
            self._serve_as_template(theirs)
        theirs.close()
        _receive(ours, 5, "the template's start")
        return ours

    def _serve_as_template(self, sock: socket.socket) -> None:
        """In the template: for each execution, fork its keeper into a new PID namespace, report the
        keeper's pid, then its wait status. Ends when the zygote does."""
        while True:
            message, fds, _, _ = socket.recv_fds(sock, 65536, 4)
            if not message:
                os._exit(0)
            limits = json.loads(message)
            _isolation.setns(self.pid_namespace, _isolation.CLONE_NEWPID, "setns back to the zygote's PID namespace")
            _isolation.unshare(_isolation.CLONE_NEWPID, "unshare(CLONE_NEWPID) for the execution")
            keeper = os.fork()
            if keeper == 0:
                sock.close()
                self._keeper(limits, tuple(fds), self._vm_size(), None)
            for fd in fds:
                os.close(fd)
            sock.send(keeper.to_bytes(4, "little"))
            sock.send(os.waitpid(keeper, 0)[1].to_bytes(4, "little"))

    def _keeper(self, limits: dict, fds: tuple[int, int, int, int], vm_size: int, workdir: str | None) -> None:
        """The execution's first process (with full isolation, process 1 of its PID namespace, so
        its end ends every process of the execution and none can see the zygote): read the code,
        confine, fork the process that runs it, report its wait status. Never returns."""
        code_r, out_w, err_w, status_w = fds
        try:
            code = _read_all(code_r)
            os.setsid()
            if self.full:
                _isolation.private_tmp(limits["disk_mb"], limits["max_files"])
            else:
                os.chdir(workdir)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0), os.dup2(out_w, 1), os.dup2(err_w, 2), os.dup2(status_w, 3)
            os.closerange(4, 2**30)  # a fixed bound: a lowered file limit must not leave one open
            sys.stdin, sys.stdout, sys.stderr = None, os.fdopen(1, "w", buffering=1), os.fdopen(2, "w", buffering=1)
            _set_limits(limits, vm_size, self.full)
            if self.full:
                _isolation.drop_capabilities()
                _seccomp.install(self.filter)
            runner = os.fork()
        except BaseException as err:
            os.write(2, f"sandbox: could not confine the execution: {str(err)[:300]}\n".encode())
            os._exit(_CONFINE_FAILED)
        if runner == 0:
            os.close(3)
            _execute(code)
        os.close(0), os.close(1), os.close(2)
        status = os.waitpid(runner, 0)[1]
        os.write(3, status.to_bytes(4, "little"))
        os._exit(0)

    def _collect(self, pid: int, out_r: int, err_r: int, deadline: float, limit: int) -> tuple[bytes, bytes, str | None]:
        """Read both pipes until they close and the child has ended, up to ``limit`` bytes each and
        until ``deadline``. When the child ends, whatever it left running is ended too, so the pipes
        it may have handed on close."""
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
                        self._kill_rest(pid)
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

    def _kill_rest(self, keeper: int) -> None:
        """Every process of the execution but the keeper (its status is still to read). With full
        isolation the kernel did this when the keeper, process 1 of their namespace, ended."""
        if not self.full:
            for child in _children():
                if child != keeper:
                    _kill(child)

    def _end(self, keeper: int) -> int:
        """Kill what is left of the execution, reap it all, and return the keeper's wait status."""
        _kill(keeper)  # with full isolation, this ends its whole PID namespace
        if self.full:  # the template is its parent and reaps it
            return int.from_bytes(_receive(self.template, 4, "the keeper's status"), "little")
        status = os.waitpid(keeper, 0)[1]
        deadline = time.monotonic() + 10
        while True:  # as subreaper every orphan is ours to reap; a fork bomb may still fork
            self._kill_rest(keeper)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError("processes of an execution survived 10 s of SIGKILL")
                    time.sleep(0.001)
            except ChildProcessError:
                return status


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


def _receive(sock: socket.socket, size: int, what: str) -> bytes:
    sock.settimeout(30)
    data = sock.recv(size)
    if len(data) != size:
        raise RuntimeError(f"{what}: the template ended")
    return data


def _reported_status(status_r: int, keeper_status: int) -> int:
    """The code's wait status as its keeper reported it; the keeper's own when it reported none
    (it was killed: timeout or output limit)."""
    try:
        data = os.read(status_r, 4) if select.select([status_r], [], [], 0)[0] else b""
    finally:
        os.close(status_r)
    return int.from_bytes(data, "little") if len(data) == 4 else keeper_status


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _children() -> list[int]:
    me, found = str(os.getpid()), []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[1] == me:
                found.append(int(name))
        except (OSError, IndexError):
            pass
    return found


def _set_limits(limits: dict, vm_size: int, full: bool) -> None:
    cpu = max(1, int(limits["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (vm_size + limits["memory_mb"] * 2**20,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["disk_mb"] * 2**20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
    if full:  # counted in the user namespace with the launcher, zygote, template and keeper
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"] + 4,) * 2)


def _execute(code: str) -> None:
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


def _classify(status: int, stopped: str | None, stderr: str, limits: dict) -> tuple[int | None, str | None]:
    if stopped == "timeout":
        return None, f"timeout: still running after {limits['wall_s']}s"
    if stopped == "output":
        return None, f"output limit ({limits['output_bytes']} bytes)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        reason = {signal.SIGXCPU: f"cpu time limit ({limits['cpu_s']}s)",
                  signal.SIGXFSZ: f"file size limit ({limits['disk_mb']} MB)",
                  signal.SIGKILL: "killed (cpu or memory limit)"}.get(sig, f"killed by signal {sig}")
        return None, reason
    code = os.WEXITSTATUS(status)
    if code == _CONFINE_FAILED and "sandbox: could not confine" in stderr:
        return None, "sandbox failure: " + stderr.strip().splitlines()[-1][:400]
    if code == _OUT_OF_MEMORY and stderr.endswith(_OUT_OF_MEMORY_TEXT.decode()):
        return code, f"memory limit ({limits['memory_mb']} MB)"
    return code, None


def _enter_namespaces() -> list:
    """In the launcher: new namespaces, the host's uid/gid maps, then fork the zygote (process 1 of
    the new PID namespace). Returns in the zygote; the launcher waits for it and exits with it."""
    if os.geteuid() == 0:
        try:
            os.setgroups([])  # root's groups would otherwise stay with the sandbox's uid
        except PermissionError:
            raise _isolation.IsolationUnavailable(_isolation.ROOT_WITHOUT_CAPS) from None
    _isolation.unshare(_isolation.NAMESPACES, "unshare(CLONE_NEWUSER|NEWNS|NEWNET|NEWIPC|NEWUTS|NEWPID)")
    sources = _isolation.open_sources(_isolation.view_sources())
    _send({"stage": "map"})
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
    config = json.loads(sys.argv[1])
    for name in PRELOAD:
        __import__(name)
    try:
        sources = _enter_namespaces() if config["isolation"] == "full" else None
        zygote = Zygote(config, sources)
        if zygote.full:
            zygote.probe()
    except (_isolation.IsolationUnavailable, _seccomp.SeccompError, OSError) as err:
        _send({"ready": False, "error": str(err)})
        os._exit(1)
    _send({"ready": True, "isolation": config["isolation"]})
    for line in sys.stdin:
        try:
            reply = zygote.run(json.loads(line))
        except Exception as err:  # the zygote must outlive any one request
            reply = {"stdout": "", "stderr": "", "exit_code": None, "error": f"sandbox failure: {err!r}",
                     "seconds": 0.0}
        _send(reply)


if __name__ == "__main__":
    main()
