"""Rewards for code and math completions, judged outside the sandbox.

A code task runs in the sandbox as one program (:func:`harness_program`): the candidate's code, then
each test's call of the entry point, and one marked line with what each call returned, as plain
data. The expected values never enter the sandbox; :func:`score_code` compares them with the
returned values here, in the env's own process. So an object that equals everything, a forged
result line, a read of the harness's frames or an early exit gains nothing: to score, the
returned values must be the right ones. Math tasks score the last number the program printed.

Rewards lie in [0, 1] (the fraction of tests passed; 1 or 0 for math), clamped to it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from envs.code.tasks import Task

SCORE_RANGE = (0.0, 1.0)


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


def clamp(reward: float, bounds: tuple[float, float] = SCORE_RANGE) -> float:
    low, high = bounds
    return low if not reward >= low else min(reward, high)  # NaN goes to the bottom
