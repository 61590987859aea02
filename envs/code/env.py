"""The code env: the model writes Python, it is executed, and the task's tests give the reward.

``reset(seed)`` shows a task; ``step(completion)`` judges the answer and ends the episode. With the
python tool (``CodeOptions.tool``) the model may run code in its own session before it answers.
The executor is anything with ``execute(code) -> ExecResult`` (the local sandbox, or Together's
Code Interpreter).
"""

from __future__ import annotations

import re

from envs.code.python_tool import PythonTool
from envs.code.reward import judge
from envs.code.sandbox import Executor
from envs.code.tasks import Task
from ray_forge.core.env import StepResult, TextEnv

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)  # [ \t]*, not \s*: no quadratic backtracking
ERROR_REWARD_RANGE = (-1.0, 0.0)


def extract_code(completion: str) -> str:
    """The last fenced Python block, or the whole completion when there is none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


TOOL_HINT = ("You may run Python first with the python tool, as often as you need (its session keeps your "
             "variables). ")


def show(task: Task, tool: bool = False) -> str:
    """The prompt of ``task``, as the env shows it (``tool``: the python tool is offered)."""
    hint = TOOL_HINT if tool else ""
    if task.kind == "answer":
        return f"{task.prompt}\n{hint}Reply with the number only."
    if task.kind == "math":
        return f"{task.prompt}\n{hint}Write a Python program that prints the answer, in a ```python block."
    if task.kind == "stdio":
        return f"{task.prompt}\n{hint}Answer with a program that reads stdin and prints the output, in a ```python block."
    return f"{task.prompt}\n{hint}Answer with the function in a ```python block."


class CodeEnv(TextEnv):
    """One task per episode, chosen by the seed. Rewards are in [0, 1] (``reward.py``), or
    ``error_reward`` (in [-1, 0]) when the execution failed or its calls never ran.

    With a ``session`` the model may call the ``python`` tool before it answers (a multi-turn
    episode, ``env.episode.mode: sequence``): its code runs in that session, one per episode. The
    answer, the turn without a tool call, is judged as ever: the task's tests run in a fresh
    execution and are scored here, outside the sandbox.

    ``held_out``: tasks no rollout sees; a negative seed shows one (seed -1 the first), for the
    evaluation."""

    action_words = None  # free-form text

    def __init__(self, tasks: list[Task], executor: Executor, error_reward: float = 0.0,
                 session: Executor | None = None, held_out: list[Task] | None = None) -> None:
        if not tasks:
            raise ValueError("CodeEnv needs at least one task")
        low, high = ERROR_REWARD_RANGE
        if not low <= error_reward <= high:
            raise ValueError(f"error_reward must lie in [{low}, {high}], got {error_reward}")
        self.tasks, self.executor, self.error_reward = tasks, executor, error_reward
        self.session, self.held_out = session, held_out or tasks
        self.task: Task | None = None

    def reset(self, seed: int) -> str:
        self.task = self._task(seed)
        self.executor.new_session()
        if self.session is not None:
            self.session.new_session()
        return show(self.task, tool=self.session is not None)

    def _task(self, seed: int) -> Task:
        if seed < 0:
            return self.held_out[(-1 - seed) % len(self.held_out)]
        return self.tasks[seed % len(self.tasks)]

    def tools(self) -> list:
        return [PythonTool(self.session)] if self.session is not None else []

    def step(self, action_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        task, self.task = self.task, None
        answer = action_text if task.kind == "answer" else extract_code(action_text)
        reward, info = judge(task, answer, self.executor)
        if info.pop("execution_failed", False):
            reward = self.error_reward
        return StepResult(info.pop("stdout", ""), reward, True, info)
