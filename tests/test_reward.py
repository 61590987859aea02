"""Rewards cannot be forged: the sandbox returns only what the calls returned, as plain data, and
the env compares it with expected values that never entered the sandbox. Each forgery scores 0
(or the error reward) on a task it does not solve; a correct solution still scores 1. Runs the
real local sandbox, and Together's Code Interpreter against a loopback server."""

from __future__ import annotations

import json
import random

import pytest

from envs.code.env import CodeEnv
from envs.code.reward import SCORE_RANGE, NoResult, harness_program, same, score_code
from envs.code.sandbox import Limits, LocalSandbox
from envs.code.tasks import Call, Task, load_tasks
from forgeries import FORGERIES, forged

ERROR_REWARD = -0.5
GCD = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a"
SECRET = "sekret-expected-7d1f"
SECRET_TASK = Task("secret", "code", "Write f(x).", entry_point="f", tests=(Call((1,), SECRET), Call((2,), [SECRET])))


@pytest.fixture(scope="module")
def sandbox():
    with LocalSandbox(size=1, limits=Limits(wall_s=5, cpu_s=4, memory_mb=512, output_bytes=64 * 1024)) as box:
        yield box


def play(executor, task: Task, code: str):
    env = CodeEnv([task], executor, error_reward=ERROR_REWARD)
    env.reset(0)
    return env.step(f"```python\n{code}\n```")


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_forgeries_score_nothing_on_tasks_they_do_not_solve(sandbox, kind):
    tasks = {t.id: t for t in load_tasks()}
    for task_id, entry_point in (("gcd", "gcd"), ("reverse_words", "reverse_words"), ("primes_below", "primes_below")):
        task = tasks[task_id]
        result = play(sandbox, task, forged(kind, entry_point))
        assert result.reward in (0.0, ERROR_REWARD), (kind, task_id, result)
        if result.reward == ERROR_REWARD:
            assert result.info["error"], result


def test_a_forged_line_with_guessed_values_scores_what_the_guesses_deserve(sandbox):
    """Forging the result line is guessing the answers: all-zero guesses for gcd's four calls
    score 0; the same program with the right answers would be a (hard-coded) solution."""
    task = next(t for t in load_tasks() if t.id == "gcd")
    assert play(sandbox, task, forged("forged_line_then_exit", "gcd")).reward == 0.0
    assert play(sandbox, task, GCD).reward == 1.0


def test_correct_solutions_still_score_one(sandbox):
    task = next(t for t in load_tasks() if t.id == "gcd")
    assert play(sandbox, task, GCD).reward == 1.0
    half = "def gcd(a, b):\n    return 6 if a == 12 else 25"  # right for (12, 18) and (100, 75)
    assert play(sandbox, task, half).reward == 0.5
    assert play(sandbox, SECRET_TASK, f"def f(x):\n    return {SECRET!r} if x == 1 else [{SECRET!r}]").reward == 1.0


def test_expected_values_never_enter_the_sandbox(sandbox):
    program = harness_program("def f(x):\n    return x", SECRET_TASK, "@@m@@")
    assert SECRET not in program
    # Looks for a str equal to the expected value (built at run time, so the hunt's own source does
    # not hold it) in every object the garbage collector tracks and in every frame's variables.
    hunt = ("import gc, sys\n"
            "def f(x):\n"
            "    needle = ''.join(['sekret', '-expected', '-7d1f'])\n"
            "    def holds(o, depth=0):\n"
            "        if isinstance(o, str):\n"
            "            return o == needle\n"
            "        items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()\n"
            "        return depth < 4 and any(holds(i, depth + 1) for i in items)\n"
            "    frames, frame = [], sys._getframe(1)\n"
            "    while frame:\n"
            "        frames.append(frame.f_locals)\n"
            "        frame = frame.f_back\n"
            "    hits = sum(holds(o) for o in gc.get_objects() + frames if o is not frames)\n"
            "    return 'found' if hits else 'none'")
    result = play(sandbox, SECRET_TASK, hunt)
    assert result.reward == 0.0 and '"value": "none"' in result.observation
    control = play(sandbox, SECRET_TASK, hunt + f"\nplanted = {{'x': {SECRET!r}}}")  # the hunt does find a value
    assert '"value": "found"' in control.observation


def test_the_reward_range_holds_for_any_result_line():
    """Whatever a program prints, the reward is in [0, 1] or the program gave no result."""
    task = next(t for t in load_tasks() if t.id == "primes_below")
    rng = random.Random(0)
    values = [None, True, 0, -1, 2.5, float("1e308"), "x", [], [2, 3], {"a": 1}, [[2]], 10**50]
    lines = ["", "@@m@@", "@@m@@{", "@@m@@[]", '@@m@@{"loaded": "yes"}', "@@m@@" + "[" * 100000,
             '@@m@@{"loaded": "yes", "results": [{"value": 1}, {"value": 2}, {"value": 3}, {"value": 4}]}',
             '@@m@@{"loaded": "yes", "results": [{"value": 1, "error": "x"}, {}, {}]}',
             '@@m@@{"loaded": "maybe", "results": []}', "@@m@@" + "9" * 5000, '@@m@@{"loaded": [], "results": []}',
             '@@m@@{"loaded": {}, "results": []}',
             "@@m@@" + json.dumps({"loaded": "yes", "results": [{"value": c.expected} for c in task.tests]})]
    values += [call.expected for call in task.tests]  # so some lines score above 0
    for _ in range(300):
        loaded = rng.choice(["yes", "yes", "yes", "raised", "missing"])
        count = len(task.tests) if loaded == "yes" else 0
        results = [rng.choice([{"value": rng.choice(values)}, {"error": "E"}]) for _ in range(count)]
        lines.append("@@m@@" + json.dumps({"loaded": loaded, "results": results}))
    outcomes = []
    for line in lines:
        try:
            reward, _ = score_code(f"noise\n{line}\n", "@@m@@", task)
        except NoResult:
            continue
        outcomes.append(reward)
        assert SCORE_RANGE[0] <= reward <= SCORE_RANGE[1]
    assert len(outcomes) > 250 and 0.0 in outcomes and 1.0 in outcomes and len(set(outcomes)) == 4
    with pytest.raises(ValueError, match="error_reward"):
        CodeEnv([task], executor=None, error_reward=-2.0)
    with pytest.raises(ValueError, match="error_reward"):
        CodeEnv([task], executor=None, error_reward=0.5)


def test_plain_data_equality_cannot_be_fooled():
    assert same(1, 1) and not same(True, 1) and not same(1, True) and not same(1.0, 1)
    assert same(1, 1.0) and same(0.1 + 0.2, 0.3) and not same("1", 1) and not same(None, 0)
    assert same([1, [2]], [1, [2]]) and not same([1, 2], [1, 2, 3]) and not same({"a": 1}, {"a": 1, "b": 2})
    assert not same([1], (1,)) and same({"a": [None]}, {"a": [None]})
    assert not same(10**400, 1.5) and not same([10**400], [2.0])  # too large for a float: no OverflowError


def test_the_same_scoring_runs_through_togethers_code_interpreter(monkeypatch):
    from together_server import TogetherServer

    from envs.code.together_interpreter import TogetherCodeInterpreter

    key = "tgp_v1_reward-test-key"
    tasks = {t.id: t for t in load_tasks()}
    with TogetherServer(key) as server:
        monkeypatch.setenv("TOGETHER_API_KEY", key)
        monkeypatch.setenv("TOGETHER_BASE_URL", server.url)
        tci = TogetherCodeInterpreter(timeout_s=10)
        assert play(tci, tasks["gcd"], GCD).reward == 1.0
        for kind in ("equals_everything", "int_subclass", "forged_line", "recursive_value", "reads_frames"):
            result = play(tci, tasks["gcd"], forged(kind, "gcd"))
            assert result.reward in (0.0, ERROR_REWARD), (kind, result)
        solution = f"def f(x):\n    return {SECRET[:6]!r} + {SECRET[6:]!r} if x == 1 else [{SECRET!r}[:]]"
        assert play(tci, SECRET_TASK, solution).reward == 1.0
        sent = [r["body"]["code"] for r in server.behaviour.requests]
        assert len(sent) == 7 and all("_rf_run(" in code for code in sent)
        assert not any(SECRET in code for code in sent[:-1])  # only the last candidate wrote it itself
