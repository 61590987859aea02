"""The local sandbox contains hostile programs, as root and as an unprivileged user: each ends
with a clear error, nothing outside is touched, the sandbox keeps working, and the next execution
is correct. Runs the real thing (user, PID, mount and network namespaces, a read-only root,
seccomp, rlimits). The unprivileged variant runs the sandbox's host process as uid 65534."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from envs.code.sandbox import ExecResult, Limits, LocalSandbox

ROOT = Path(__file__).resolve().parent.parent
LIMITS = Limits(wall_s=3.0, cpu_s=2.0, memory_mb=256, output_bytes=16 * 1024, max_processes=8, disk_mb=8,
                max_files=256, max_open_files=32)
KEY = "sk-test-secret-never-in-sandbox"
UNPRIVILEGED_UID = 65534


# How ``setpriv`` runs the sandbox's host for each mode: an unprivileged user (no capabilities at
# all), and root without CAP_SYS_ADMIN, as in an ordinary pod.
SETPRIV = {"user": f"--reuid={UNPRIVILEGED_UID} --regid={UNPRIVILEGED_UID} --clear-groups --inh-caps=-all "
                   "--bounding-set=-all",
           "root_without_sys_admin": "--inh-caps=-sys_admin --bounding-set=-sys_admin"}


class SubprocessHost:
    """The sandbox's host process run by ``setpriv`` (see SETPRIV), serving ``tests/sandbox_host.py``.

    The Python installation may sit under a folder only root may enter (/root here), so the host
    runs in a private mount namespace where that folder is an empty tmpfs with just the Python
    installation bound back in place; envs/code is copied to a folder anyone may read."""

    def __init__(self, mode: str) -> None:
        self.uid = UNPRIVILEGED_UID if mode == "user" else None
        self.code_dir = tempfile.mkdtemp(prefix="ray_forge_sandbox_code_")
        shutil.copytree(ROOT / "envs" / "code", Path(self.code_dir) / "envs" / "code",
                        ignore=shutil.ignore_patterns("__pycache__", "*.jsonl"))
        (Path(self.code_dir) / "envs" / "__init__.py").touch()
        for path in [self.code_dir, *Path(self.code_dir).rglob("*")]:
            os.chmod(path, 0o755)
        python = sys._base_executable
        script = "set -e\n" + _expose(sys.base_prefix) + (
            f"exec setpriv {SETPRIV[mode]} -- {python} {self.code_dir}/host.py {self.code_dir} "
            f"'{json.dumps(LIMITS.__dict__)}'")
        shutil.copy(ROOT / "tests" / "sandbox_host.py", Path(self.code_dir) / "host.py")
        os.chmod(Path(self.code_dir) / "host.py", 0o755)
        env = {"PATH": os.environ["PATH"], "TOGETHER_API_KEY": KEY}
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = json.loads(self._line(60))
        assert ready["ready"], ready
        self.pids = ready["pids"]

    def _line(self, timeout_s: float) -> str:
        import select

        readable, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if readable else ""
        assert line, f"the sandbox host did not answer within {timeout_s}s"
        return line

    def execute(self, code: str) -> ExecResult:
        self.proc.stdin.write(json.dumps({"code": code}) + "\n")
        self.proc.stdin.flush()
        return ExecResult(**json.loads(self._line(LIMITS.wall_s + 30)))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.code_dir, ignore_errors=True)


def _expose(prefix: str) -> str:
    """Shell lines that make ``prefix`` reachable for every user: the highest folder above it that
    others may not enter becomes a 0755 tmpfs with ``prefix`` bound back in place."""
    blocked = next((p for p in reversed(Path(prefix).parents) if not os.stat(p).st_mode & stat.S_IXOTH), None)
    if blocked is None:
        return ""
    return (f"aside=$(mktemp -d)\nmount --bind {prefix} $aside\nmount -t tmpfs -o mode=0755 tmpfs {blocked}\n"
            f"mkdir -p {prefix}\nmount --bind $aside {prefix}\n")


class RootHost:
    """The sandbox in this process (root in CI)."""

    def __init__(self) -> None:
        os.environ["TOGETHER_API_KEY"] = KEY
        self.box = LocalSandbox(size=1, limits=LIMITS)
        self.pids = self.box.pids

    def execute(self, code: str) -> ExecResult:
        return self.box.execute(code)

    def close(self) -> None:
        self.box.close()
        os.environ.pop("TOGETHER_API_KEY", None)


@pytest.fixture(scope="module", params=["root", "root_without_sys_admin", "user"])
def host(request):
    if request.param != "user" and os.geteuid() != 0:
        pytest.skip("the root variants need root (CI runs as root); the unprivileged one ran in-process")
    if request.param == "user" and os.geteuid() != 0:
        made = RootHost()  # this process already is an unprivileged user
    else:
        made = RootHost() if request.param == "root" else SubprocessHost(request.param)
    yield made
    made.close()


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def only_the_zygote_is_left(host) -> None:
    """Below the launcher there are just the zygote and the template it forks executions from:
    nothing an execution started survived it."""
    deadline = time.monotonic() + 5
    while len(left := descendants(host.pids[0])) != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(left) == 2, f"processes left below the sandbox's launcher: {left}"


def still_correct(host) -> None:
    result = host.execute("print(sum(range(10)))")
    assert result.ok and result.stdout == "45\n", result


def test_plain_code_runs_and_reports(host):
    result = host.execute("import math\nprint(math.factorial(5))")
    assert result.ok and result.stdout == "120\n" and result.error is None
    failed = host.execute("raise ValueError('bad input')")
    assert failed.exit_code == 1 and failed.error is None and "ValueError: bad input" in failed.stderr


def test_dot_dot_above_its_root_and_open_by_handle_reach_nothing_of_the_host(host):
    """An attack the first reviews did not try: climbing above the pivoted root by path, through
    an O_PATH descriptor of '/', or by a file handle of a host inode."""
    code = ("import ctypes, os\nfd = os.open('/', os.O_PATH)\n"
            "print(sorted(os.listdir('/../../..')) == sorted(os.listdir('/')))\n"
            "print(sorted(os.listdir(os.open('..', os.O_RDONLY, dir_fd=fd))) == sorted(os.listdir('/')))\n"
            "os.chdir('/tmp/../../..')\nprint(os.getcwd(), os.path.exists('/work'), os.path.exists('/root/.bashrc'))\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.open_by_handle_at(fd, ctypes.create_string_buffer(64), 0), ctypes.get_errno())\n")
    result = host.execute(code)
    assert result.stdout == "True\nTrue\n/ False False\n-1 1\n", result
    still_correct(host)


def test_it_sees_only_what_python_needs(host):
    result = host.execute("import os\nprint(sorted(os.listdir('/')))\nprint(os.getcwd(), os.listdir('.'))\n"
                          "import json, fractions, zipfile\nprint('imports ok')")
    top = set(json.loads(result.stdout.splitlines()[0].replace("'", '"')))
    assert top <= {"dev", "lib", "lib64", "usr", "tmp", "root", "opt", "home"}, top
    assert not top & {"proc", "sys", "etc", "work", "var", "run", "mnt"}
    assert result.stdout.splitlines()[1] == "/tmp []" and "imports ok" in result.stdout


def test_infinite_loop_is_stopped(host):
    start = time.monotonic()
    result = host.execute("while True:\n    pass")
    assert result.error is not None and ("cpu time" in result.error or "timeout" in result.error)
    assert time.monotonic() - start < LIMITS.wall_s + 3
    still_correct(host)


def test_sleeping_forever_while_ignoring_sigterm_is_killed_on_time(host):
    start = time.monotonic()
    result = host.execute("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(100)")
    assert result.error.startswith("timeout")
    assert time.monotonic() - start < LIMITS.wall_s + 3
    still_correct(host)


def test_memory_bomb_hits_the_memory_limit(host):
    result = host.execute("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))")
    assert result.error is not None and "memory" in result.error
    still_correct(host)


def test_a_gigabyte_of_output_is_cut_off(host):
    start = time.monotonic()
    result = host.execute("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)")
    assert result.error is not None and "output limit" in result.error
    assert len(result.stdout) <= LIMITS.output_bytes
    assert time.monotonic() - start < LIMITS.wall_s + 3
    still_correct(host)


def test_fork_bomb_is_contained_and_leaves_nothing(host):
    result = host.execute("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert result.error is not None or result.exit_code != 0
    only_the_zygote_is_left(host)
    still_correct(host)


def test_the_process_limit_holds(host):
    code = ("import os, time\nmade = 0\nfor _ in range(50):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        made += 1\n    except OSError:\n        break\n"
            "print(made)")
    result = host.execute(code)
    assert result.ok and int(result.stdout) == LIMITS.max_processes - 1, result  # the execution itself is one
    only_the_zygote_is_left(host)
    still_correct(host)


def test_background_process_does_not_outlive_the_execution(host):
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n"
            "print('child', pid)")
    result = host.execute(code)
    assert result.ok and result.stdout.startswith("child ")
    only_the_zygote_is_left(host)
    still_correct(host)


def listening(count: int) -> tuple[list[socket.socket], list[list]]:
    servers, accepted = [], []
    for _ in range(count):
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(0.5)
        got: list = []
        threading.Thread(target=lambda s=server, g=got: _accept(s, g), daemon=True).start()
        servers.append(server)
        accepted.append(got)
    return servers, accepted


def _accept(server: socket.socket, got: list) -> None:
    try:
        got.append(server.accept())
    except OSError:
        pass


def test_no_network_to_the_ray_dashboard_the_gcs_or_dns(host):
    """Listeners on loopback stand for the Ray dashboard and the GCS; 8265 and 6379 are their
    default ports."""
    servers, accepted = listening(2)
    ports = [s.getsockname()[1] for s in servers] + [8265, 6379]
    code = ("import socket\n"
            f"for port in {ports}:\n"
            "    try:\n        socket.create_connection(('127.0.0.1', port), timeout=1)\n        print('connected', port)\n"
            "    except OSError as err:\n        print('refused', port, type(err).__name__)\n"
            "try:\n    print('resolved', socket.getaddrinfo('example.com', 80))\n"
            "except OSError as err:\n    print('no dns', type(err).__name__)\n")
    result = host.execute(code)
    time.sleep(0.6)
    for server in servers:
        server.close()
    assert "connected" not in result.stdout and "resolved" not in result.stdout and not any(accepted)
    assert result.stdout.count("refused") == 4 and "no dns" in result.stdout, result
    still_correct(host)


def test_no_secrets_in_its_environment_or_any_process(host):
    code = ("import os\nprint(sorted(os.environ))\n"
            "for path in (f'/proc/{os.getppid()}/environ', '/proc/1/environ', '/proc/self/environ'):\n"
            "    try:\n        print(open(path, 'rb').read())\n    except OSError as err:\n"
            "        print('denied', path, type(err).__name__)\n")
    result = host.execute(code)
    assert KEY not in result.stdout + result.stderr and "TOGETHER_API_KEY" not in result.stdout
    assert result.stdout.count("denied") == 3
    still_correct(host)


def test_cannot_write_outside_its_directory(host):
    target = f"/tmp/ray_forge_escape_{uuid.uuid4().hex}"
    elsewhere = tempfile.mkdtemp(prefix="ray_forge_elsewhere_")
    os.chmod(elsewhere, 0o777)
    code = (f"for path in ({target!r}, '../escape', '/escape', {elsewhere + '/escape'!r}, '/usr/lib/escape'):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as err:\n        print('refused', path)\n"
            "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())")
    result = host.execute(code)
    assert not Path(target).exists() and not os.listdir(elsewhere)
    assert result.stdout.count("refused") == 4 and result.stdout.strip().endswith("ok"), result
    assert "inside.txt" not in host.execute("import os\nprint(os.listdir('.'))").stdout  # its own /tmp is new
    os.rmdir(elsewhere)
    still_correct(host)


def test_links_where_output_was_read_and_where_cleanup_ran_reach_nothing(host):
    """The old sandbox read <dir>/stdout after the run and removed <dir>: links planted there
    pointed the host at its own files. Now output comes through pipes and nothing is cleaned up."""
    secret = Path(tempfile.mkdtemp(prefix="ray_forge_secret_"))
    (secret / "token").write_text("host-file-secret-123")
    os.chmod(secret, 0o755), os.chmod(secret / "token", 0o644)
    code = ("import os\n"
            f"for name, target in [('stdout', {str(secret / 'token')!r}), ('stderr', '/proc/1/environ'),\n"
            f"                     ('victim', {str(secret)!r}), ('root', '/')]:\n"
            "    for where in (name, '../' + name, '/tmp/' + name):\n"
            "        try:\n            os.symlink(target, where)\n        except OSError:\n            pass\n"
            "print('planted', sorted(os.listdir('.')))")
    result = host.execute(code)
    assert result.ok and "planted" in result.stdout
    assert "host-file-secret-123" not in result.stdout + result.stderr and KEY not in result.stdout + result.stderr
    assert (secret / "token").read_text() == "host-file-secret-123"  # nothing followed the links to remove it
    shutil.rmtree(secret)
    still_correct(host)


def refused_calls(host, calls: dict[str, str], before: str = "") -> None:
    """Each libc call (name -> call text, ``libc.`` omitted) returns -1 with EPERM."""
    code = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n" + before + "".join(
        f"print({name!r}, libc.{call}, ctypes.get_errno())\n" for name, call in calls.items())
    result = host.execute(code)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert set(lines) == set(calls), result
    assert all(value == "-1 1" for value in lines.values()), lines


def test_ctypes_kill_socket_and_ptrace_are_refused(host):
    kills = f"for pid in (os.getppid(), 1, {os.getpid()}, -1):\n    libc.kill(pid, 9)\n"
    refused_calls(host, {"socket": "socket(2, 1, 0)", "raw": "socket(17, 3, 0)",
                         "attach": "ptrace(16, os.getppid(), 0, 0)", "traceme": "ptrace(0, 0, 0, 0)",
                         "unshare": "unshare(0x10000000)", "execve": "execve(b'/usr/bin/env', None, None)"}, kills)
    assert all(Path(f"/proc/{pid}").exists() for pid in host.pids)
    still_correct(host)


def test_no_dev_shm_and_no_data_volume(host):
    name = f"ray_forge_escape_{uuid.uuid4().hex}"
    pvc = tempfile.mkdtemp(prefix="ray_forge_pvc_")  # stands for the PVC mounted at /data
    os.chmod(pvc, 0o777)
    code = (f"for path in ('/dev/shm/{name}', '{pvc}/{name}', '/data/{name}'):\n"
            "    try:\n        open(path, 'wb').write(b'x' * 1024)\n        print('wrote', path)\n"
            "    except OSError as err:\n        print('refused', path, type(err).__name__)\n")
    result = host.execute(code)
    assert result.stdout.count("refused") == 3, result
    assert not Path(f"/dev/shm/{name}").exists() and not os.listdir(pvc)
    os.rmdir(pvc)
    still_correct(host)


def test_filling_the_disk_with_small_files_is_contained(host):
    free_before = shutil.disk_usage("/tmp").free
    code = ("import os\nmade = 0\ntry:\n    while True:\n"
            "        with open(f'f{made}', 'wb') as f:\n            f.write(b'x' * 4096)\n        made += 1\n"
            "except OSError as err:\n    print('stopped', made, err.strerror)\n")
    result = host.execute(code)
    assert result.ok and "stopped" in result.stdout and "No space left" in result.stdout, result
    assert int(result.stdout.split()[1]) < LIMITS.max_files
    assert abs(shutil.disk_usage("/tmp").free - free_before) < 64 * 2**20  # the host's disk was not used
    assert host.execute("import os\nprint(len(os.listdir('.')))").stdout == "0\n"
    still_correct(host)


def test_opening_files_without_end_is_contained(host):
    code = ("files = []\ntry:\n    while True:\n        files.append(open('/dev/null'))\n"
            "except OSError as err:\n    print('stopped', len(files), err.strerror)\n")
    result = host.execute(code)
    assert result.ok and "Too many open files" in result.stdout, result
    assert int(result.stdout.split()[1]) < LIMITS.max_open_files
    still_correct(host)


def test_signalling_its_parent_the_host_or_everyone_harms_nothing(host):
    code = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, 1, -1):\n"
            "    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):\n"
            "        try:\n            os.kill(pid, sig)\n        except OSError:\n            pass\n"
            "print('still here')")
    result = host.execute(code)
    assert result.error is not None or "still here" in result.stdout  # kill(-1) may take the execution too
    assert all(Path(f"/proc/{pid}").exists() for pid in host.pids)
    still_correct(host)  # the zygote, the host and this test all survived


def test_renicing_every_process_of_its_uid_slows_nothing_outside(host):
    """setpriority(PRIO_USER) reaches every process of a uid; run as the host's own uid (the user
    host), it could push the env actor and every Ray worker to nice 19. The execution's PID
    namespace keeps it to what it can see: its own processes."""
    def nice(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])

    outside = [os.getpid(), *host.pids, *descendants(host.pids[0])]
    outside += [host.proc.pid] if hasattr(host, "proc") else []  # the user host's own process
    before = {pid: nice(pid) for pid in outside}
    code = ("import os\nfor which, who in ((os.PRIO_USER, 0), (os.PRIO_USER, os.getuid()), (os.PRIO_PGRP, 0)):\n"
            "    try:\n        os.setpriority(which, who, 19)\n    except OSError:\n        pass\n"
            "print(os.getpriority(os.PRIO_PROCESS, 0))")
    result = host.execute(code)
    assert result.error is None and result.stdout.strip() == "19"  # it did renice what it can see: itself
    assert {pid: nice(pid) for pid in outside} == before
    still_correct(host)


def test_the_sandbox_runs_as_an_unprivileged_uid(host):
    """Launcher, zygote and template hold an unprivileged uid on the machine (65534 for the user
    host; a dedicated one when the host is root), whatever they are called inside their namespace."""
    for pid in [host.pids[0], *descendants(host.pids[0])]:
        uids = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:"))
        real, effective, saved, fs = map(int, uids.split()[1:])
        assert real == effective == saved == fs != 0
        if getattr(host, "uid", None) is not None:
            assert real == host.uid


# Fail closed: the host process runs under a seccomp filter (as a container profile would be) that
# refuses the calls named (EPERM) and allows the rest, or under no filter when none is named; the
# sandbox must refuse to start and say what is missing.
_START_UNDER_FILTER = """
import sys
sys.path.insert(0, {root!r})
from envs.code import _bpf, _seccomp, _syscalls
if {refused!r}:
    numbers = _syscalls.native().NUMBERS
    refuse = [_bpf.jump(_bpf.JEQ, numbers[name], then="refuse") for name in {refused!r}]
    _seccomp.install(_bpf.assemble([_bpf.load(0), *refuse, _bpf.ret(0x7FFF0000), "refuse", _bpf.ret(0x00050001)]))
from envs.code.sandbox import LocalSandbox, SandboxUnavailable
try:
    LocalSandbox(size=1).close()
    print("STARTED")
except SandboxUnavailable as err:
    print("REFUSED", err)
"""


def start_under_filter(refused: list[str], prefix: tuple[str, ...] = ()) -> str:
    """What a sandbox started in a process under that filter said ("STARTED" or "REFUSED <why>")."""
    script = _START_UNDER_FILTER.format(root=str(ROOT), refused=refused)
    out = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith(("STARTED", "REFUSED")), out.stdout + out.stderr
    return out.stdout


def test_a_host_filter_that_refuses_nothing_the_sandbox_needs_lets_it_start():
    """The control for the refusals below: the same filter, refusing a call the sandbox never makes."""
    assert start_under_filter(["acct"]).startswith("STARTED")


@pytest.mark.parametrize("refused, named", [
    (["unshare"], "unshare(CLONE_NEWUSER"),
    (["mount"], "mount of"),
    (["seccomp"], "seccomp"),
    (["pivot_root"], "pivot_root"),
    (["prctl"], "prctl("),
])
def test_without_what_isolation_needs_the_sandbox_refuses_to_start(refused, named):
    said = start_under_filter(refused)
    assert said.startswith("REFUSED") and named in said and "isolation 'full'" in said, said
    if refused[0] in ("unshare", "mount", "pivot_root"):
        assert "seccompProfile" in said and "env.options.code.isolation: none" in said  # how to get it


def test_on_an_architecture_without_a_syscall_table_full_isolation_refuses_to_start():
    """setarch i686 makes uname say i686 to the sandbox's processes: the filter has no table for it
    (its every call would be killed), so the sandbox refuses, naming the architecture."""
    said = start_under_filter([], prefix=("setarch", "i686"))
    assert said.startswith("REFUSED") and "this is i686" in said and "x86_64" in said and "aarch64" in said, said


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to drop CAP_SETUID from root")
def test_root_without_cap_setuid_is_refused_not_run_as_root():
    """Root in a pod with its capabilities dropped cannot map the sandbox to another uid; running
    it as root would lift the process limit, so the sandbox refuses."""
    said = start_under_filter([], prefix=("setpriv", "--bounding-set=-setuid,-setgid", "--inh-caps=-setuid,-setgid",
                                          "--"))
    assert said.startswith("REFUSED") and "CAP_SETUID" in said, said


def test_isolation_none_is_an_explicit_opt_in_and_says_so(caplog):
    with pytest.raises(ValueError, match="isolation must be one of"):
        LocalSandbox(size=1, isolation="partial")
    with LocalSandbox(size=1, limits=LIMITS, isolation="none") as box:
        assert box.isolation == "none"
        assert "isolation 'none'" in caplog.text
        result = box.execute("import os\nprint(os.path.exists('/proc/self'))")
        assert result.ok and result.stdout == "True\n"  # no namespaces: it sees the machine
        assert "timeout" in box.execute("import time\ntime.sleep(60)").error  # the limits still hold
        still_correct(box)


def test_no_process_outside_the_execution_is_visible_to_tamper_with(host):
    """Its first process is process 1 of a PID namespace of its own: the zygote that forks the
    next executions cannot be reached to lower its limits (prlimit needs only the same uid)."""
    code = ("import os, resource\nreached = []\nfor pid in range(1, 200):\n"
            "    if pid in (1, os.getpid()):\n        continue\n"
            "    try:\n        resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, 3))\n        reached.append(pid)\n"
            "    except OSError:\n        pass\n"
            "resource.prlimit(1, resource.RLIMIT_NOFILE, (3, 3))\nresource.prlimit(1, resource.RLIMIT_DATA, (2**20,) * 2)\n"
            "print(os.getpid(), os.getppid(), reached)")
    result = host.execute(code)
    assert result.ok and result.stdout == "2 1 []\n", result
    after = host.execute("import os, resource\nopen_fds = []\nfor fd in range(3, 4096):\n    try:\n        os.fstat(fd)\n"
                         "        open_fds.append(fd)\n    except OSError:\n        pass\n"
                         "print(resource.getrlimit(resource.RLIMIT_NOFILE), "
                         "resource.getrlimit(resource.RLIMIT_DATA)[0] == resource.RLIM_INFINITY, open_fds)\nx = bytearray(50 * 2**20)")
    assert after.ok and after.stdout == f"({LIMITS.max_open_files}, {LIMITS.max_open_files}) True []\n", after
    still_correct(host)


def test_memory_the_kernel_would_keep_or_share_is_refused(host):
    """System V shared memory, message queues, semaphores and memfd are outside every rlimit, and
    the first two outlive the execution; locks on the read-only files (flock, and fcntl's record and
    open-file locks, set or queried) are a channel between sandboxes."""
    shared_file = ("fd = os.open('/usr/lib/os-release' if os.path.exists('/usr/lib/os-release') else '/dev/null', 0)\n"
                   "lock = ctypes.create_string_buffer(32)  # struct flock: a read lock on the whole file\n")
    refused_calls(host, {"shmget": "shmget(0x5EC7, 1 << 20, 0o1666)", "msgget": "msgget(0x5EC7, 0o1666)",
                         "semget": "semget(0x5EC7, 1, 0o1666)", "mq_open": "mq_open(b'/q', 0o100 | 2, 0o600, None)",
                         "memfd": "memfd_create(b'm', 0)", "flock": "flock(fd, 2 | 4)",
                         "F_SETLK": "fcntl(fd, 6, lock)", "F_GETLK": "fcntl(fd, 5, lock)",
                         "F_OFD_SETLK": "fcntl(fd, 37, lock)"}, shared_file)
    still_correct(host)


def raw_calls(calls: dict[str, str]) -> str:
    """A program that makes each call (name -> its arguments) by number, as this machine numbers it,
    and prints ``name result errno``."""
    from envs.code import _syscalls

    numbers = _syscalls.native().NUMBERS
    return "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n" + "".join(
        f"print({name!r}, libc.syscall({numbers[name]}, {args}), ctypes.get_errno())\n" for name, args in calls.items())


def answers(result: ExecResult) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


# Calls no program here needs that the old denylist let through, with arguments that make them work.
UNNEEDED = {"io_setup": "1, ctypes.byref(ctypes.c_ulong(0))", "inotify_init1": "0", "sync": "",
            "setxattr": "b'.', b'user.x', b'1', 1, 0", "mbind": "0, 0, 0, None, 0, 0"}


@pytest.fixture(scope="module")
def unfiltered():
    """Isolation none: the same calls without the filter, to show that they work there."""
    with LocalSandbox(size=1, limits=LIMITS, isolation="none") as box:
        yield box


def test_calls_off_the_allowlist_are_refused_even_those_the_old_denylist_let_through(host, unfiltered):
    """The filter is an allowlist. Calls Python never makes (kexec_load, add_key, the new mount API)
    are refused with EPERM, and so are calls the old denylist allowed that no program here needs:
    an AIO context, inotify, sync, setting an extended attribute, a NUMA policy. Without the
    filter, the same calls run."""
    never = {"kexec_load": "0, 0, None, 0", "add_key": "b'user', b'k', b'v', 1, -3", "fsopen": "b'tmpfs', 0"}
    refused = answers(host.execute(raw_calls(never | UNNEEDED)))
    assert refused == dict.fromkeys(never | UNNEEDED, "-1 1"), refused
    ran = answers(unfiltered.execute(raw_calls(UNNEEDED)))
    assert set(ran) == set(UNNEEDED) and "-1 1" not in ran.values(), ran  # none refused with EPERM
    assert ran["io_setup"] == "0 0" and int(ran["inotify_init1"].split()[0]) > 2, ran
    still_correct(host)


def test_clone3_and_calls_newer_than_the_table_answer_enosys_so_libc_falls_back(host, unfiltered):
    """glibc creates threads with clone3 and falls back to clone on ENOSYS; a call added after the
    table was generated (fchmodat2, 452, Linux 6.6) answers ENOSYS too, as on an older kernel, so
    libc uses the older form. Threads still start."""
    from envs.code import _syscalls

    newer = max(_syscalls.native().NUMBERS.values()) + 2
    code = (raw_calls({"clone3": "None, 0"}) + f"print('newer', libc.syscall({newer}, -100, b'x', 0o600, 0), "
            "ctypes.get_errno())\nimport threading\nthreading.Thread(target=print, args=('thread', 'ran')).start()\n")
    result = host.execute(code)
    assert answers(result) == {"clone3": "-1 38", "newer": "-1 38", "thread": "ran"}, result
    ran = answers(unfiltered.execute(code))
    assert ran["clone3"] == "-1 22" and ran["thread"] == "ran", ran  # EINVAL: the kernel read the call
    if tuple(map(int, os.uname().release.split(".")[:2])) >= (6, 6):
        assert ran["newer"] == "-1 2", ran  # ENOENT: fchmodat2 ran


def test_argument_checks_refuse_namespaces_terminal_injection_and_leases(host):
    """clone with a namespace flag (the filter reads clone's flags; clone3's are behind a pointer),
    ioctl TIOCSTI (pushing input into a terminal), fcntl F_SETLEASE and F_SETOWN: refused; the
    commands Python uses still work (os.set_inheritable needs FIOCLEX)."""
    from envs.code import _syscalls

    clone = _syscalls.native().NUMBERS["clone"]
    refused_calls(host, {"clone_newnet": f"syscall({clone}, 0x40000000 | 17, 0, 0, 0, 0)",
                         "clone_newuser": f"syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0)",
                         "tiocsti": "ioctl(1, 0x5412, b'x')", "lease": "fcntl(0, 1024, 0)", "owner": "fcntl(0, 8, 1)"})
    result = host.execute("import os\nr, w = os.pipe()\nos.set_inheritable(r, True)\nos.set_blocking(w, False)\n"
                          "print(os.get_inheritable(r), os.get_blocking(w), os.isatty(1), os.dup(r) > r)")
    assert result.ok and result.stdout == "True False False True\n", result


def test_a_program_posing_as_a_sandbox_failure_only_fails_itself(host):
    code = ("import os\nn = 16 * 1024\nos.write(1, b'\\x01' * (n - 1))\n"
            "os.write(2, b'sandbox: could not confine\\n' + b'\\x01' * (n - 40))\nos._exit(126)")
    result = host.execute(code)
    assert result.error is not None and len(result.error) < 500
    fake = host.execute("import sys\nprint('MemoryError', file=sys.stderr)")
    assert fake.ok and fake.error is None
    assert all(Path(f"/proc/{pid}").exists() for pid in host.pids)  # the same interpreter, not a respawn
    still_correct(host)


_MEMORY_SCAN = """
import ctypes, os
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
r, w = os.pipe()
def readable(addr):  # write() answers EFAULT for an unmapped page instead of crashing
    if libc.write(w, addr, 1) == 1:
        os.read(r, 1)
        return True
    return False
needle = bytes.fromhex({needle_hex!r})
hits, seen = 0, []
for seed in (libc.malloc(64), libc.malloc(300000), id(object()), id("x" * 5000), id(os)):
    if any(lo <= seed < hi for lo, hi in seen):
        continue
    lo = hi = seed & ~4095
    while readable(lo - 4096) and hi - lo < 2**30:
        lo -= 4096
    while readable(hi) and hi - lo < 2**30:
        hi += 4096
    seen.append((lo, hi))
    hits += ctypes.string_at(lo, hi - lo).count(needle)
print("regions", len(seen), "hits", hits)
"""


def test_no_execution_inherits_another_ones_code_or_output(host):
    """Executions are forked from a process that never held a request or a reply, so one rollout
    cannot copy a sibling's code or result line out of the memory it inherited. The scan reads
    every page around its heap and objects, as an attacker did."""
    secret = f"SIBLING-{uuid.uuid4().hex}"
    assert host.execute(f"print({secret!r})").stdout == secret + "\n"
    result = host.execute(_MEMORY_SCAN.format(needle_hex=secret.encode().hex()))
    assert result.ok and result.stdout.endswith(" hits 1\n"), result  # only its own search term
    control = host.execute(f"kept = {secret!r} * 2\n" + _MEMORY_SCAN.format(needle_hex=secret.encode().hex()))
    assert control.ok and int(control.stdout.split()[-1]) > 1, control  # the scan does find what is there


def test_an_execution_that_ended_and_was_reaped_before_its_pid_arrived_is_still_collected():
    """Full isolation: the template forks each execution's keeper and reaps it; a fast program can
    end, and be reaped, before the zygote opens a pidfd on it (seen once in 72 executions of a job
    on a loaded machine, as "sandbox failure: ProcessLookupError"). Its output is still read."""
    from envs.code import _runner

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(out_w, b"7\n")
        os._exit(0)
    os.waitpid(pid, 0)  # reaped, as the template does: the pid names no process now
    os.close(out_w), os.close(err_w)
    with pytest.raises(ProcessLookupError):
        os.pidfd_open(pid)
    ended = []
    out, err, stopped = _runner.collect(pid, out_r, err_r, time.monotonic() + 5, 1024, ended.append)
    assert (out, err, stopped, ended) == (b"7\n", b"", None, [])
    os.close(out_r), os.close(err_r)


def test_a_shared_futex_cannot_be_woken_so_no_sandbox_signals_another_through_libc_s_pages(host):
    """A shared futex at an address in libc's pages is keyed by the file: a wake from one sandbox
    would reach another waiting there. Shared wakes are refused; private futexes (every lock and
    condition of threads) and pthread_join's shared wait still work."""
    from envs.code import _syscalls

    futex = _syscalls.native().NUMBERS["futex"]
    page = "ctypes.cast(libc.getpid, ctypes.c_void_p).value & ~0xfff"
    refused_calls(host, {"shared_wake": f"syscall({futex}, {page}, 1, 1, 0, 0, 0)",
                         "shared_requeue": f"syscall({futex}, {page}, 3, 1, 1, {page} + 64, 0)"})
    result = host.execute("import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
                          "done = []\nthreads = [threading.Thread(target=done.append, args=(i,)) for i in range(4)]\n"
                          "[t.start() for t in threads]\n[t.join() for t in threads]\n"
                          "with ThreadPoolExecutor(4) as pool:\n    squares = sum(pool.map(lambda x: x * x, range(100)))\n"
                          "cond = threading.Condition()\nwith cond:\n    cond.wait(0.01)\n"
                          "print(sorted(done), squares)")
    assert result.ok and result.stdout == "[0, 1, 2, 3] 328350\n", result
