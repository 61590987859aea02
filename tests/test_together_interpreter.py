"""Together's Code Interpreter backend against a real loopback HTTP server speaking its JSON."""

from __future__ import annotations

import logging
import time

import pytest
from together_server import TogetherServer

from envs.code.env import CodeEnv
from envs.code.tasks import load_tasks
from envs.code.together_interpreter import TogetherCodeInterpreter

KEY = "tgp_v1_test-key-never-logged"


@pytest.fixture
def server(monkeypatch):
    with TogetherServer(KEY) as srv:
        monkeypatch.setenv("TOGETHER_API_KEY", KEY)
        monkeypatch.setenv("TOGETHER_BASE_URL", srv.url)
        yield srv


def test_one_session_per_episode_keeps_state(server):
    tci = TogetherCodeInterpreter(timeout_s=5)
    assert tci.execute("x = 41").ok
    result = tci.execute("print(x + 1)")
    assert result.ok and result.stdout == "42\n"
    first, second = server.behaviour.requests
    assert "session_id" not in first["body"] and second["body"]["session_id"] == tci.session_id
    assert [s["id"] for s in tci.sessions()] == [tci.session_id]
    tci.new_session()
    assert "NameError" in tci.execute("print(x)").stderr  # a new episode starts clean


def test_errors_in_the_code_are_outputs_not_failures(server):
    result = TogetherCodeInterpreter(timeout_s=5).execute("1 / 0")
    assert result.exit_code == 1 and result.error is None and "ZeroDivisionError" in result.stderr


def test_an_expired_session_is_recreated(server):
    tci = TogetherCodeInterpreter(timeout_s=5)
    tci.execute("y = 1")
    old = tci.session_id
    server.behaviour.expired.add(old)
    result = tci.execute("print('again')")
    assert result.ok and result.stdout == "again\n" and tci.session_id != old
    assert [r["body"].get("session_id") for r in server.behaviour.requests] == [None, old, None]


def test_429_and_500_are_retried(server):
    server.behaviour.fail_next = [429, 500]
    result = TogetherCodeInterpreter(timeout_s=5, max_retries=3).execute("print('ok')")
    assert result.ok and result.stdout == "ok\n" and len(server.behaviour.requests) == 3


def test_persistent_failure_is_a_clear_error_after_the_retries(server):
    server.behaviour.fail_next = [503] * 5
    result = TogetherCodeInterpreter(timeout_s=5, max_retries=2).execute("print('ok')")
    assert result.error == "code interpreter answered HTTP 503" and len(server.behaviour.requests) == 3


def test_a_slow_service_times_out(server):
    server.behaviour.delay_s = 3.0
    start = time.monotonic()
    result = TogetherCodeInterpreter(timeout_s=0.5, max_retries=0).execute("print('late')")
    assert result.error.startswith("timeout") and time.monotonic() - start < 2.5


def test_the_key_is_only_in_the_auth_header_and_never_logged(server, caplog):
    caplog.set_level(logging.DEBUG)
    tci = TogetherCodeInterpreter(timeout_s=5)
    server.behaviour.fail_next = [500]
    tci.execute("import os\nprint(sorted(os.environ)[:3])")
    for request in server.behaviour.requests:
        assert request["auth"] == f"Bearer {KEY}"
        assert KEY not in str(request["body"])
    assert KEY not in caplog.text
    assert KEY not in repr(tci.execute("print(1)"))


def test_a_wrong_key_is_an_error_not_a_crash(server, monkeypatch):
    monkeypatch.setenv("TOGETHER_API_KEY", "wrong")
    result = TogetherCodeInterpreter(timeout_s=5).execute("print(1)")
    assert result.error == "code interpreter answered HTTP 401"


def test_the_code_env_scores_through_the_code_interpreter(server):
    env = CodeEnv(load_tasks(), TogetherCodeInterpreter(timeout_s=5))
    seed = [t.id for t in env.tasks].index("gcd")
    env.reset(seed)
    assert env.step("```python\nimport math\ndef gcd(a, b):\n    return math.gcd(a, b)\n```").reward == 1.0
    first_session = env.executor.session_id
    env.reset(seed)  # a new episode: a new session
    assert env.executor.session_id is None
    assert env.step("```python\ndef gcd(a, b):\n    return 6\n```").reward == pytest.approx(0.25)
    assert env.executor.session_id != first_session


def test_a_call_that_returns_after_its_episode_ended_does_not_hand_its_session_on():
    """The python tool gives up on a slow call; when it returns, the next episode has started and
    must not find itself in the old episode's session."""
    from envs.code.together_interpreter import TogetherCodeInterpreter

    class LateClient:
        def post(self, path, body, cast_to):
            interpreter.new_session()  # the episode ended while this call was in flight
            return {"data": {"outputs": [{"type": "stdout", "data": "late"}], "session_id": "old"}, "errors": None}

    interpreter = TogetherCodeInterpreter(client=LateClient())
    assert interpreter.execute("x = 1").stdout == "late"
    assert interpreter.session_id is None
