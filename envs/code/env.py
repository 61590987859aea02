"""The code env: the model writes Python, it is executed, and the task's tests give the reward.

Single-turn: ``reset(seed)`` shows a task, ``step(completion)`` runs the code once and ends the
episode. The executor is anything with ``execute(code) -> ExecResult`` (the local sandbox, or
Together's Code Interpreter).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Protocol

from envs.code.sandbox import ExecResult
from envs.code.tasks import Task
from ray_forge.env import StepResult

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


class Executor(Protocol):
    def execute(self, code: str) -> ExecResult: ...


def extract_code(completion: str) -> str:
    """The last fenced Python block, or the whole completion when there is none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def test_program(candidate: str, tests: tuple[str, ...], marker: str) -> str:
    """Candidate code, then each hidden test in isolation, then one marked result line.

    The harness keeps its own references to ``print`` and ``sys.stdout`` before the candidate
    runs, so replacing either does not fake a result (and it works in Jupyter-like remote
    interpreters, which capture ``sys.stdout`` rather than file descriptor 1). The marker is random per step and not in the
    prompt. (A candidate can still read this program's frames: trust the reward no more than a
    sandboxed unit-test run.)"""
    return "\n".join([
        "import sys as _rf_sys, json as _rf_json",
        "_rf_print, _rf_out, _rf_dumps = print, _rf_sys.stdout, _rf_json.dumps",
        "_rf_ns = {'__name__': '__main__'}",
        "try:",
        f"    exec(compile({candidate!r}, '<solution>', 'exec'), _rf_ns)",
        "    _rf_loaded = True",
        "except BaseException as _rf_err:",
        "    _rf_loaded = False",
        "_rf_passed = 0",
        f"for _rf_test in {list(tests)!r}:",
        "    try:",
        "        _rf_passed += bool(_rf_loaded and eval(_rf_test, _rf_ns))",
        "    except BaseException:",
        "        pass",
        f"_rf_print('\\n{marker}' + _rf_dumps({{'passed': _rf_passed, 'loaded': _rf_loaded}}), file=_rf_out, flush=True)",
    ])


def score_math(stdout: str, answer: float) -> float:
    """1 when the last number printed equals the answer (to 1e-6 relative), else 0."""
    numbers = _NUMBER.findall(stdout)
    if not numbers:
        return 0.0
    value = float(numbers[-1])
    return float(abs(value - answer) <= 1e-6 * max(1.0, abs(answer)))


class CodeEnv:
    """One task per episode, chosen by the seed."""

    action_words = None  # free-form text

    def __init__(self, tasks: list[Task], executor: Executor, error_reward: float = 0.0) -> None:
        if not tasks:
            raise ValueError("CodeEnv needs at least one task")
        self.tasks, self.executor, self.error_reward = tasks, executor, error_reward
        self.task: Task | None = None

    def reset(self, seed: int) -> str:
        self.task = self.tasks[seed % len(self.tasks)]
        if hasattr(self.executor, "new_session"):  # a remote interpreter: one session per episode
            self.executor.new_session()
        if self.task.kind == "code":
            return f"{self.task.prompt}\nAnswer with the function in a ```python block."
        return f"{self.task.prompt}\nWrite a Python program that prints the answer, in a ```python block."

    def step(self, action_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        task, self.task = self.task, None
        code = extract_code(action_text)
        if task.kind == "math":
            result = self.executor.execute(code)
            info = {"task": task.id, "stderr": result.stderr[-500:]}
            if result.error:
                return StepResult("", self.error_reward, True, dict(info, error=result.error))
            return StepResult(result.stdout[-500:], score_math(result.stdout, task.answer), True, info)
        marker = f"@@rf-result-{secrets.token_hex(8)}@@"
        result = self.executor.execute(test_program(code, task.tests, marker))
        info = {"task": task.id, "stderr": result.stderr[-500:]}
        found = [line for line in result.stdout.splitlines() if line.startswith(marker)]
        if result.error or not found:
            return StepResult("", self.error_reward, True,
                              dict(info, error=result.error or "the program ended before its tests ran"))
        outcome = json.loads(found[-1][len(marker):])
        if not outcome["loaded"]:
            info["error"] = "the solution raised when defined"
        return StepResult(result.stdout[-500:], outcome["passed"] / len(task.tests), True, info)
