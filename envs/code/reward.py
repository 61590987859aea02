"""Rewards for code, stdin/stdout and math completions, judged outside the sandbox.

A code task runs in the sandbox as one program (:func:`harness_program`): the candidate's code, then
each test's call of the entry point, and one marked line with what each call returned, as plain
data. The expected values never enter the sandbox; :func:`score_code` compares them with the
returned values here, in the env's own process. So an object that equals everything, a forged
result line, a read of the harness's frames or an early exit gains nothing: to score, the
returned values must be the right ones. Math tasks score the last number the program printed;
answer tasks, the last number of the reply, which nothing executes.

A stdio task runs the candidate once per case (:func:`stdin_program`), its stdin given as a
literal; the expected stdout never enters the sandbox, and :func:`same_output` compares it with
what was printed, here. A program cannot pass by printing something clever: it never saw the text
it is compared with.

Rewards lie in [0, 1] (the fraction of tests or cases passed; 1 or 0 for math), clamped to it.
:func:`judge` scores any task and says in its info when the execution itself failed.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import TYPE_CHECKING, Any

from envs.code.tasks import Task

if TYPE_CHECKING:
    from envs.code.sandbox import ExecResult, Executor

SCORE_RANGE = (0.0, 1.0)
MAX_CASES = 16
"""A stdio task runs at most its first this many cases per judgement: each is an execution of its
own, and a task with 200 cases must not hold the env for minutes. It also stops at the first case
the sandbox stopped (timeout, a limit): a program that timed out once would time out again."""
SHOWN_CHARS = 500  # the tail of stdout and stderr kept in a judgement's info
_UNCOMPILED = 97  # the exit status of a stdio program whose candidate does not compile


class NoResult(ValueError):
    """The program gave no usable result line (it ended early, or printed a forged or broken one)."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_FAILED = object()  # a call that raised, or returned something that is not plain data
_LOADED = {"yes": "", "raised": "the solution raised when defined",
           "missing": "the solution does not define `{}`"}

# Runs inside the sandbox (locally or in Together's Code Interpreter); nothing here is trusted.
_HARNESS = '''
import copy as _rf_copy, json as _rf_json, sys as _rf_sys


def _rf_plain(value, depth=0, budget=None):
    """Only exact None, bool, int, float, str, list, tuple and dict with str keys, finite and bounded."""
    budget = [100000] if budget is None else budget
    budget[0] -= 1
    kind = type(value)
    if budget[0] < 0 or depth > 64:
        raise ValueError("the value is too large or nested too deeply")
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        if value.bit_length() > 4096:
            raise ValueError("an int too large")
        return value
    if kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("a float that is not finite")
        return value
    if kind is list or kind is tuple:
        return [_rf_plain(item, depth + 1, budget) for item in value]
    if kind is dict:
        if not all(type(key) is str for key in value):
            raise TypeError("a dict key that is not a str")
        return {key: _rf_plain(item, depth + 1, budget) for key, item in value.items()}
    raise TypeError("not plain data")


def _rf_run(candidate, entry_point, calls, marker):
    out, dumps, deepcopy = _rf_sys.stdout, _rf_json.dumps, _rf_copy.deepcopy
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(candidate, "<solution>", "exec"), namespace)
        function = namespace.get(entry_point)
        loaded = "yes" if callable(function) else "missing"
    except BaseException:
        function, loaded = None, "raised"
    results = []
    for args in calls if loaded == "yes" else ():
        try:
            results.append({"value": _rf_plain(function(*deepcopy(args)))})
        except BaseException as err:
            results.append({"error": str(type(err).__name__)})
    out.write("\\n" + marker + dumps({"loaded": loaded, "results": results}) + "\\n")
    out.flush()
'''


def harness_program(candidate: str, task: Task, marker: str) -> str:
    """The program the sandbox runs for a code task: the task's calls, never its expected values."""
    calls = [list(call.args) for call in task.tests]
    return _HARNESS + f"\n_rf_run({candidate!r}, {task.entry_point!r}, {calls!r}, {marker!r})\n"


def same(value: Any, expected: Any) -> bool:
    """Plain-data equality that a type cannot fake: bool is not int, 1.0 matches 1 only where a
    float is expected (to 1e-9 relative), lists and dicts compare item by item."""
    if expected is None or isinstance(expected, (bool, str)):
        return type(value) is type(expected) and value == expected
    if isinstance(expected, int):
        return type(value) is int and value == expected
    if isinstance(expected, float):
        try:
            return type(value) in (int, float) and math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-12)
        except OverflowError:  # an int too large for a float
            return False
    if isinstance(expected, list):
        return type(value) is list and len(value) == len(expected) and all(map(same, value, expected))
    if isinstance(expected, dict):
        return (type(value) is dict and value.keys() == expected.keys()
                and all(same(value[key], expected[key]) for key in expected))
    return False


def read_results(stdout: str, marker: str, task: Task) -> tuple[str, list]:
    """What the harness reported: whether the solution loaded ("yes", "raised", "missing") and the
    values its calls returned (``_FAILED`` for a failed call). Raises :class:`NoResult`."""
    lines = [line for line in stdout.splitlines() if line.startswith(marker)]
    if len(lines) != 1:
        raise NoResult("the program ended before its tests ran" if not lines else
                       f"{len(lines)} result lines: the program printed one of its own")
    try:
        report = json.loads(lines[0][len(marker):])
    except (ValueError, RecursionError):
        raise NoResult("the result line is not readable") from None
    loaded = report.get("loaded") if isinstance(report, dict) else None
    results = report.get("results") if isinstance(report, dict) else None
    if (not isinstance(loaded, str) or loaded not in _LOADED or not isinstance(results, list)
            or len(results) != (len(task.tests) if loaded == "yes" else 0)
            or not all(isinstance(r, dict) and ("value" in r) != ("error" in r) for r in results)):
        raise NoResult("the result line is malformed")
    return loaded, [result.get("value", _FAILED) for result in results]


def score_code(stdout: str, marker: str, task: Task) -> tuple[float, str | None]:
    """The fraction of the task's calls that returned their expected value, and why it is 0 when
    the solution could not be called. Raises :class:`NoResult` when the program gave no result."""
    loaded, values = read_results(stdout, marker, task)
    if loaded != "yes":
        return 0.0, _LOADED[loaded].format(task.entry_point)
    passed = sum(value is not _FAILED and same(value, call.expected) for value, call in zip(values, task.tests))
    return clamp(passed / len(task.tests)), None


def score_math(stdout: str, answer: float) -> float:
    """1 when the last number printed equals the answer (to 1e-6 relative), else 0."""
    numbers = _NUMBER.findall(stdout)
    if not numbers:
        return 0.0
    value = float(numbers[-1])
    return clamp(float(abs(value - answer) <= 1e-6 * max(1.0, abs(answer))))


def _judge_answer(task: Task, reply: str) -> tuple[float, dict]:
    """A stated answer: the last number of the reply itself. Nothing runs, so nothing the model
    wrote or ran (a program, a forged line in a tool's output) is read but its own words."""
    info = {"task": task.id, "stderr": "", "stdout": ""}
    numbers = _NUMBER.findall(reply)
    if not numbers:
        info["error"] = "the reply states no number"
        return 0.0, info
    if float(task.answer).is_integer():  # exactly: a near guess of a 7-digit number is no answer
        return float(_exact(numbers[-1]) == int(task.answer)), info
    return score_math(reply, task.answer), info


def _exact(number: str) -> int | None:
    """``number`` as an integer if it is one (``42``, ``42.0``), else None."""
    try:
        value = float(number)
    except (ValueError, OverflowError):
        return None
    return int(value) if value.is_integer() and abs(value) < 2**53 else None


def clamp(reward: float, bounds: tuple[float, float] = SCORE_RANGE) -> float:
    low, high = bounds
    return low if not reward >= low else min(reward, high)  # NaN goes to the bottom


# --- stdin/stdout tasks -------------------------------------------------------------------------

# Runs inside the sandbox: the candidate, compiled apart so that one that does not compile is told
# from one that fails a case, reading the case's stdin. Nothing here is trusted.
_STDIN_PROGRAM = '''
import io as _rf_io, sys as _rf_sys
try:
    _rf_code = compile(_rf_candidate, "<solution>", "exec")
except (SyntaxError, ValueError) as _rf_err:
    _rf_sys.stderr.write(f"{type(_rf_err).__name__}: {_rf_err}\\n")
    _rf_sys.exit(%d)
_rf_sys.stdin = _rf_io.TextIOWrapper(_rf_io.BytesIO(_rf_stdin), encoding="utf-8")
del _rf_candidate, _rf_stdin
exec(_rf_code, {"__name__": "__main__"})
''' % _UNCOMPILED


def stdin_program(candidate: str, stdin: str) -> str:
    """The program the sandbox runs for one case of a stdio task: the candidate, reading ``stdin``
    (as ``sys.stdin``, with a ``.buffer``; not file descriptor 0), in a fresh ``__main__`` namespace."""
    data = stdin.encode("utf-8", "replace")
    return f"_rf_candidate = {candidate!r}\n_rf_stdin = {data!r}\n" + _STDIN_PROGRAM


_INTEGER = re.compile(r"[-+]?\d+")


def _lines(text: str) -> list[str]:
    """Lines without their trailing whitespace, trailing empty lines dropped."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _same_token(got: str, expected: str) -> bool:
    """Equal text, or two numbers equal to 1e-6 relative (1e-9 absolute). Two integers must be
    equal exactly: a tolerance would pass 1000000 for 1000001."""
    if got == expected:
        return True
    if _INTEGER.fullmatch(got) and _INTEGER.fullmatch(expected):
        return False
    try:
        return math.isclose(float(got), float(expected), rel_tol=1e-6, abs_tol=1e-9)
    except (ValueError, OverflowError):
        return False


def same_output(got: str, expected: str) -> bool:
    """Whether printed text matches the expected stdout: line by line, each line's whitespace-
    separated tokens compared by :func:`_same_token` (case matters)."""
    got_lines, expected_lines = _lines(got), _lines(expected)
    if len(got_lines) != len(expected_lines):
        return False
    for line, expected_line in zip(got_lines, expected_lines):
        tokens, expected_tokens = line.split(), expected_line.split()
        if len(tokens) != len(expected_tokens) or not all(map(_same_token, tokens, expected_tokens)):
            return False
    return True


def _case_failure(result: ExecResult, expected: str) -> str | None:
    """Why one case failed, or None when it passed."""
    if result.error:
        return result.error
    if result.exit_code == _UNCOMPILED:
        return "the solution does not compile"
    if result.exit_code != 0:
        return f"the program exited with status {result.exit_code}"
    return None if same_output(result.stdout, expected) else "wrong output"


def _judge_stdio(task: Task, code: str, executor: Executor) -> tuple[float, dict]:
    cases = task.cases[:MAX_CASES]
    passed, why, shown = 0, None, None
    for number, case in enumerate(cases, start=1):
        result = executor.execute(stdin_program(code, case.stdin))
        failure = _case_failure(result, case.stdout)
        passed += failure is None
        if failure and why is None:
            why, shown = f"case {number}: {failure}", result
        if result.error and number == 1:  # no case ran to its end
            reward, info = _failed(task, result, why)
            return reward, dict(info, cases=len(cases), passed=0)
        if result.error or result.exit_code == _UNCOMPILED:
            break
    shown = shown or result
    info = {"task": task.id, "stderr": shown.stderr[-SHOWN_CHARS:], "stdout": shown.stdout[-SHOWN_CHARS:],
            "cases": len(cases), "passed": passed}
    if why:
        info["error"] = why
    return clamp(passed / len(cases)), info


# --- any task ------------------------------------------------------------------------------------


def _failed(task: Task, result: ExecResult, why: str) -> tuple[float, dict]:
    return 0.0, {"task": task.id, "stderr": result.stderr[-SHOWN_CHARS:], "stdout": "", "error": why,
                 "execution_failed": True}


def _judge_math(task: Task, code: str, executor: Executor) -> tuple[float, dict]:
    result = executor.execute(code)
    if result.error:
        return _failed(task, result, result.error)
    info = {"task": task.id, "stderr": result.stderr[-SHOWN_CHARS:], "stdout": result.stdout[-SHOWN_CHARS:]}
    return score_math(result.stdout, task.answer), info


def _judge_code(task: Task, code: str, executor: Executor) -> tuple[float, dict]:
    marker = f"@@rf-result-{secrets.token_hex(8)}@@"
    result = executor.execute(harness_program(code, task, marker))
    if result.error:
        return _failed(task, result, result.error)
    try:
        reward, why = score_code(result.stdout, marker, task)
    except NoResult as err:
        return _failed(task, result, str(err))
    info = {"task": task.id, "stderr": result.stderr[-SHOWN_CHARS:], "stdout": result.stdout[-SHOWN_CHARS:]}
    if why:
        info["error"] = why
    return reward, info


def judge(task: Task, code: str, executor: Executor) -> tuple[float, dict]:
    """The reward of the candidate ``code`` (already taken out of the completion; for an answer
    task, the whole reply) for ``task``, of any kind, and an info dict: "task", the tails of "stdout" and "stderr", and "error" (why) when
    it did not fully pass; stdio tasks add "cases" (those judged, at most :data:`MAX_CASES`; the
    reward is the fraction of them passed) and "passed".

    When the execution itself failed (the sandbox stopped it, or a code task's calls never
    reported), info has ``"execution_failed": True``, "stdout" is empty and the reward is 0.0: the
    caller maps that to its own error reward (``CodeEnv``'s ``error_reward``). A solution that ran
    but could not be called, or failed every test, scores 0.0 without that flag."""
    if task.kind == "math":
        return _judge_math(task, code, executor)
    if task.kind == "answer":
        return _judge_answer(task, code)
    if task.kind == "stdio":
        return _judge_stdio(task, code, executor)
    return _judge_code(task, code, executor)
