"""The code env: the model writes Python, it is executed, and the task's tests give the reward.

Single-turn: ``reset(seed)`` shows a task, ``step(completion)`` runs the code once and ends the
episode. The executor is anything with ``execute(code) -> ExecResult`` (the local sandbox, or
Together's Code Interpreter).
"""

from __future__ import annotations

import re
import secrets

from envs.code.reward import NoResult, harness_program, score_code, score_math
from envs.code.sandbox import Executor
from envs.code.tasks import Task
from ray_forge.core.env import StepResult, TextEnv

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)  # [ \t]*, not \s*: no quadratic backtracking
ERROR_REWARD_RANGE = (-1.0, 0.0)


def extract_code(completion: str) -> str:
    """The last fenced Python block, or the whole completion when there is none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def show(task: Task) -> str:
    """The prompt of ``task``, as the env shows it."""
    if task.kind == "code":
        return f"{task.prompt}\nAnswer with the function in a ```python block."
    return f"{task.prompt}\nWrite a Python program that prints the answer, in a ```python block."


class CodeEnv(TextEnv):
    """One task per episode, chosen by the seed. Rewards are in [0, 1] (``reward.py``), or
    ``error_reward`` (in [-1, 0]) when the execution failed or its calls never ran."""

    action_words = None  # free-form text

    def __init__(self, tasks: list[Task], executor: Executor, error_reward: float = 0.0) -> None:
        if not tasks:
            raise ValueError("CodeEnv needs at least one task")
        low, high = ERROR_REWARD_RANGE
        if not low <= error_reward <= high:
            raise ValueError(f"error_reward must lie in [{low}, {high}], got {error_reward}")
        self.tasks, self.executor, self.error_reward = tasks, executor, error_reward
        self.task: Task | None = None

    def reset(self, seed: int) -> str:
        self.task = self.tasks[seed % len(self.tasks)]
        self.executor.new_session()
        return show(self.task)

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
        result = self.executor.execute(harness_program(code, task, marker))
        info = {"task": task.id, "stderr": result.stderr[-500:]}
        if result.error:
            return StepResult("", self.error_reward, True, dict(info, error=result.error))
        try:
            reward, why = score_code(result.stdout, marker, task)
        except NoResult as err:
            return StepResult("", self.error_reward, True, dict(info, error=str(err)))
        if why:
            info["error"] = why
        return StepResult(result.stdout[-500:], reward, True, info)
