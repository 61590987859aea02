"""The local sandbox contains hostile programs: each ends with a clear error, the sandbox keeps
working, and the next execution is correct. Runs the real thing (forked interpreters, rlimits,
and as root a uid, chroot and network namespace)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from envs.code.sandbox import Limits, LocalSandbox

LIMITS = Limits(wall_s=3.0, cpu_s=2.0, memory_mb=256, output_bytes=16 * 1024, max_processes=8)


@pytest.fixture(scope="module")
def sandbox():
    os.environ["TOGETHER_API_KEY"] = "sk-test-secret-never-in-sandbox"
    box = LocalSandbox(size=1, limits=LIMITS)
    yield box
    box.close()
    os.environ.pop("TOGETHER_API_KEY", None)


def processes_of(uid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,comm=", "-u", str(uid)], capture_output=True, text=True)
    return out.stdout.split("\n") if out.stdout.strip() else []


def still_correct(box: LocalSandbox) -> None:
    result = box.execute("print(sum(range(10)))")
    assert result.ok and result.stdout == "45\n", result


def test_plain_code_runs_and_reports(sandbox):
    result = sandbox.execute("import math\nprint(math.factorial(5))")
    assert result.ok and result.stdout == "120\n" and result.error is None
    failed = sandbox.execute("raise ValueError('bad input')")
    assert failed.exit_code == 1 and failed.error is None and "ValueError: bad input" in failed.stderr


def test_infinite_loop_is_stopped(sandbox):
    start = time.monotonic()
    result = sandbox.execute("while True:\n    pass")
    assert result.error is not None and ("cpu time" in result.error or "timeout" in result.error)
    assert time.monotonic() - start < LIMITS.wall_s + 3
    still_correct(sandbox)


def test_sleeping_forever_while_ignoring_sigterm_is_killed_on_time(sandbox):
    start = time.monotonic()
    result = sandbox.execute("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(100)")
    assert result.error.startswith("timeout")
    assert time.monotonic() - start < LIMITS.wall_s + 3
    still_correct(sandbox)


def test_memory_bomb_hits_the_memory_limit(sandbox):
    result = sandbox.execute("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))")
    assert result.error is not None and "memory" in result.error
    still_correct(sandbox)


def test_a_gigabyte_of_output_is_cut_off(sandbox):
    start = time.monotonic()
    result = sandbox.execute("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)")
    assert result.error is not None and "output limit" in result.error
    assert len(result.stdout) <= LIMITS.output_bytes
    assert time.monotonic() - start < LIMITS.wall_s + 3
    still_correct(sandbox)


def test_fork_bomb_is_contained_and_leaves_nothing(sandbox):
    result = sandbox.execute("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert result.error is not None or result.exit_code != 0
    if sandbox.isolated:
        assert processes_of(sandbox.uids[0]) == []
    still_correct(sandbox)


def test_background_process_does_not_outlive_the_execution(sandbox):
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n"
            "print('child', pid)")
    result = sandbox.execute(code)
    assert result.ok and result.stdout.startswith("child ")
    child = int(result.stdout.split()[1])
    assert not Path(f"/proc/{child}").exists()
    if sandbox.isolated:
        assert processes_of(sandbox.uids[0]) == []
    still_correct(sandbox)


def test_no_network_even_to_a_loopback_server(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    result = sandbox.execute(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                             "print('connected')")
    thread.join()
    server.close()
    assert "connected" not in result.stdout and not accepted
    assert result.exit_code != 0 and ("OSError" in result.stderr or "PermissionError" in result.stderr
                                      or "Network is unreachable" in result.stderr)
    still_correct(sandbox)


def test_no_secrets_in_its_environment_or_the_parents(sandbox):
    code = ("import os\nprint(sorted(os.environ))\n"
            "for path in (f'/proc/{os.getppid()}/environ', '/proc/1/environ', f'/proc/{os.getpid()}/environ'):\n"
            "    try:\n        print(open(path, 'rb').read())\n    except OSError as err:\n        print('denied', path)\n")
    result = sandbox.execute(code)
    assert "sk-test-secret" not in result.stdout + result.stderr
    assert "TOGETHER_API_KEY" not in result.stdout
    still_correct(sandbox)


def test_cannot_write_outside_its_directory(sandbox, tmp_path):
    target = f"/tmp/ray_forge_escape_{uuid.uuid4().hex}"
    code = (f"for path in ({target!r}, '../escape', {str(tmp_path / 'escape')!r}):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as err:\n        print('refused', path)\n"
            "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())")
    result = sandbox.execute(code)
    assert not Path(target).exists() and not (tmp_path / "escape").exists()
    assert result.stdout.strip().endswith("ok")
    leftovers = [p for p in Path(sandbox.root).rglob("escape")]
    assert leftovers == []
    still_correct(sandbox)


def test_cannot_signal_or_kill_its_parent(sandbox):
    me = os.getpid()
    code = (f"import os, signal\nfor pid in (os.getppid(), {me}, 1):\n"
            "    for sig in (signal.SIGTERM, signal.SIGKILL):\n"
            "        try:\n            os.kill(pid, sig)\n            print('signalled', pid)\n"
            "        except OSError as err:\n            print('refused', pid, type(err).__name__)\n")
    result = sandbox.execute(code)
    assert "signalled" not in result.stdout
    assert result.stdout.count("refused") == 6  # 3 targets x 2 signals, each refused
    still_correct(sandbox)  # the sandbox's interpreter survived too


def test_audit_hook_fallback_without_root_measures():
    with LocalSandbox(size=1, limits=LIMITS, isolate=False) as box:
        assert not box.isolated
        result = box.execute("import socket\nsocket.socket()")
        assert "PermissionError" in result.stderr and "socket" in result.stderr
        result = box.execute("import os\nos.fork()")
        assert "PermissionError" in result.stderr
        still_correct(box)
