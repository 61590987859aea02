"""The sandbox's warm interpreter: forks one child per execution (never imports ray_forge).

Run as ``python -I _zygote.py <config json>`` with a scrubbed environment. It reads one request per
line on stdin (JSON: code, limits) and answers one JSON line on stdout. Each execution is a fresh
forked child in its own session and private directory, with CPU, memory, file-size and process
limits. When this process is root it also: leaves the network (a new, empty network namespace,
made once here), runs the child as a dedicated uid inside a chroot of its directory, and after the
child ends kills every process of that uid (so nothing it started survives, even if it escaped
its session). Without root a Python audit hook refuses sockets, subprocesses and signals instead.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time

# What candidate code may import, loaded before any chroot (there is no stdlib inside it).
PRELOAD = ("math", "cmath", "re", "json", "itertools", "functools", "collections", "heapq", "bisect",
           "string", "random", "fractions", "decimal", "statistics", "typing", "dataclasses", "copy",
           "operator", "datetime", "textwrap", "unicodedata", "array", "enum", "traceback", "io", "time",
           "signal", "socket", "encodings.idna")
_CLONE_NEWNET = 0x40000000
_PR_SET_CHILD_SUBREAPER = 36
_REFUSED_EVENTS = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.kill",
                   "os.killpg", "os.fork", "os.forkpty", "pty.spawn")


def _refuse(event: str, args) -> None:
    if event.startswith(_REFUSED_EVENTS):
        raise PermissionError(f"sandbox: {event} is not allowed")


def _leave_network() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(_CLONE_NEWNET) == 0


def _vm_size() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _limit(kind: int, value: int) -> None:
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass  # a limit the OS refuses (e.g. above the hard limit) keeps its current value


def _child(code: str, limits: dict, workdir: str, uid: int | None) -> None:
    """In the forked child: confine, then run the code. Never returns."""
    try:
        _confine(limits, workdir, uid)
    except BaseException as err:
        os.write(2, f"sandbox: could not confine the execution: {err!r}\n".encode())
        os._exit(126)
    status = 0
    try:
        exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except MemoryError:
        os.write(2, b"MemoryError: the sandbox's memory limit was reached\n")
        status = 137
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


def _confine(limits: dict, workdir: str, uid: int | None) -> None:
    vm_size = _vm_size()  # before any chroot hides /proc
    os.setsid()
    out = os.open(os.path.join(workdir, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(os.path.join(workdir, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0), os.dup2(out, 1), os.dup2(err, 2)
    os.closerange(3, 1 << 16)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    if uid is not None:
        os.chown(workdir, uid, uid)
        for name in ("stdout", "stderr"):
            os.chown(os.path.join(workdir, name), uid, uid)
        os.chroot(workdir)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.chdir("/")
    else:
        os.chdir(workdir)
        sys.addaudithook(_refuse)
    cpu = max(1, int(limits["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    _limit(resource.RLIMIT_AS, vm_size + limits["memory_mb"] * 2**20)
    _limit(resource.RLIMIT_FSIZE, limits["output_bytes"])
    _limit(resource.RLIMIT_NPROC, limits["max_processes"])
    _limit(resource.RLIMIT_CORE, 0)


def _uid_pids(uid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    found.append(int(name))
            except FileNotFoundError:
                pass
    return found


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` (the child, and anything it left behind or hid in a new
    session), and reap them: this process is their subreaper, and unreaped zombies would still
    count against the uid's process limit."""
    deadline = time.monotonic() + 10
    while _uid_pids(uid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of uid {uid} survived 10 s of SIGKILL")
        helper = os.fork()
        if helper == 0:
            os.setuid(uid)
            for _ in range(3):  # kill(-1): all this uid may signal but itself; a fork bomb may fork behind a sweep
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break
            os._exit(0)
        while os.waitpid(-1, 0)[0] != helper:  # reaping killed orphans on the way
            pass
        _reap()


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _read(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def _classify(status: int, timed_out: bool, stderr: str, out_size: int, limits: dict) -> tuple[int | None, str | None]:
    if timed_out:
        return None, f"timeout: still running after {limits['wall_s']}s"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        reason = {signal.SIGXCPU: f"cpu time limit ({limits['cpu_s']}s)",
                  signal.SIGXFSZ: f"output limit ({limits['output_bytes']} bytes)",
                  signal.SIGKILL: "killed (cpu or memory limit)"}.get(sig, f"killed by signal {sig}")
        return None, reason
    code = os.WEXITSTATUS(status)
    if "MemoryError" in stderr:
        return code, f"memory limit ({limits['memory_mb']} MB)"
    if out_size >= limits["output_bytes"]:
        return code, f"output limit ({limits['output_bytes']} bytes)"
    return code, None


def run(request: dict, root: str, uid: int | None) -> dict:
    limits = request["limits"]
    workdir = tempfile.mkdtemp(prefix="x", dir=root)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(request["code"], limits, workdir, uid)
    deadline = start + limits["wall_s"]
    timed_out, status = False, 0
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            timed_out = True
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.0005 if time.monotonic() - start < 0.05 else 0.005)
    seconds = time.monotonic() - start
    if uid is not None:
        _kill_uid(uid)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)  # whatever it left in its session
        except ProcessLookupError:
            pass
    out_path = os.path.join(workdir, "stdout")
    stdout = _read(out_path, limits["output_bytes"])
    stderr = _read(os.path.join(workdir, "stderr"), limits["output_bytes"])
    out_size = os.path.getsize(out_path) if os.path.exists(out_path) else 0
    shutil.rmtree(workdir, ignore_errors=True)
    exit_code, error = _classify(status, timed_out, stderr, out_size, limits)
    return {"stdout": stdout, "stderr": stderr, "exit_code": exit_code, "error": error, "seconds": seconds}


def main() -> None:
    config = json.loads(sys.argv[1])
    isolated = os.geteuid() == 0 and config.get("isolate", True)
    uid = config["uid"] if isolated else None
    network_off = _leave_network() if isolated else False
    # Orphans of an execution become this process's children, so they can be reaped here.
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for name in PRELOAD:
        __import__(name)
    print(json.dumps({"ready": True, "isolated": isolated, "network_namespace": network_off}), flush=True)
    for line in sys.stdin:
        try:
            reply = run(json.loads(line), config["root"], uid)
        except Exception as err:  # the zygote must outlive any one request
            reply = {"stdout": "", "stderr": "", "exit_code": None, "error": f"sandbox failure: {err!r}",
                     "seconds": 0.0}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
