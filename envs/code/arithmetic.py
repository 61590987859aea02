"""A task family a tiny model cannot solve in its head and can solve with the python tool.

``What is 4821 * 307 + 55?``: the product of a 4-digit and a 3-digit number plus a small one has
7 digits, and a 1M-10M-parameter model does not multiply. With the tool it only has to copy the
numbers into ``print(4821 * 307 + 55)`` and the printed result into its reply. The answer is
stated, not executed (task kind ``answer``, judged by ``reward.py`` outside the sandbox).

The splits are drawn from one seeded generator: the held-out questions are the next ones drawn
that are not in the train split, so the two never overlap and a seed fixes both.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from envs.code.tasks import Task


@dataclass(frozen=True, kw_only=True)
class Arithmetic:
    """Generated ``a * b + c`` questions (``env.options.code.arithmetic``); ``train: 0``: off."""

    train: int = 0
    """Questions the rollouts are dealt."""
    held_out: int = 200
    """Questions only the evaluation shows."""
    seed: int = 0
    """Seeds the questions of both splits."""
    digits: tuple[int, int] = (4, 3)
    """Digits of ``a`` and of ``b``; ``c`` has 2, the answer as many as ``a`` and ``b`` together."""

    def __post_init__(self) -> None:
        if self.train < 0 or self.held_out < 1:
            raise ValueError(f"arithmetic needs train >= 0 and held_out >= 1, got {self.train} and {self.held_out}")
        if len(self.digits) != 2 or not all(1 <= d <= 6 for d in self.digits):
            raise ValueError(f"arithmetic.digits must be two numbers of digits in 1..6, got {self.digits}")
        possible = 10 ** (sum(self.digits) + 1)  # about: a, b, and 90 values of c, some answers too short
        if self.train + self.held_out > possible // 100:
            raise ValueError(f"{self.train + self.held_out} questions of {self.digits} digits would repeat: ask fewer")

    def splits(self) -> tuple[list[Task], list[Task]]:
        """(train, held-out): disjoint, and the same for the same seed."""
        rng = random.Random(f"arithmetic-{self.seed}")
        drawn: dict[str, Task] = {}
        while len(drawn) < self.train + self.held_out:
            task = question(rng, self.digits)
            drawn.setdefault(task.id, task)
        tasks = list(drawn.values())
        return tasks[:self.train], tasks[self.train:]


def question(rng: random.Random, digits: tuple[int, int]) -> Task:
    """Every number of a width fixed by ``digits``: ``c`` has 2 digits and the answer as many as
    ``a`` and ``b`` together. So a question and its answer always sit at the same offsets in the
    chat, and what a tiny model must learn is to copy, not to count digits (a 6-digit answer
    among 7-digit ones was miscopied most: measured)."""
    while True:
        a = rng.randrange(10 ** (digits[0] - 1), 10 ** digits[0])
        b = rng.randrange(10 ** (digits[1] - 1), 10 ** digits[1])
        c = rng.randrange(10, 100)
        if len(str(a * b + c)) == sum(digits):
            return Task(f"{a}*{b}+{c}", "answer", f"What is {a} * {b} + {c}?", answer=float(a * b + c))


@dataclass(frozen=True, kw_only=True)
class Mix:
    """Shares of the warm start's demonstrations; the rest are wrong guesses made without the tool.

    Chosen so that the warm-started policy solves part of the held-out questions and leaves room
    to learn: it calls the tool about as often as ``tool`` + ``broken`` and is right about ``tool``
    of the time, the guesses and broken calls being what RL must unlearn. A mistake is a call
    that fails, never a miscopied digit: demonstrations that miscopy teach the model to copy
    noisily, which sampling then does on every call (measured: the sampled pass rate stalled at
    two thirds of the greedy one)."""

    tool: float = 0.4
    """The tool called with the question's numbers, and its output given as the answer."""
    broken: float = 0.1
    """The tool called with code that does not compile; after its error, a guess."""

    def __post_init__(self) -> None:
        if not (0 <= self.tool and 0 <= self.broken and self.tool + self.broken <= 1):
            raise ValueError(f"mix shares must be >= 0 and add up to at most 1, got {self.tool} and {self.broken}")


SYNTAX_ERROR = "SyntaxError: '(' was never closed"


def demonstrations(tasks: list[Task], mix: Mix, seed: int) -> list[dict]:
    """One conversation per task (``{"messages", "tools"}``, the SFT job's input), in the chat the
    code env shows with the python tool, drawn by ``mix``."""
    from envs.code.env import show
    from envs.code.python_tool import SCHEMA

    rng = random.Random(f"demonstrations-{seed}")
    out = []
    for task in tasks:
        messages = [{"role": "user", "content": show(task, tool=True)}]
        draw, answer = rng.random(), str(int(task.answer))
        if draw < mix.tool + mix.broken:
            broken = draw >= mix.tool
            code = f"print({_expression(task)}" + ("" if broken else ")")
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]},
                         {"role": "tool", "name": "python", "content": SYNTAX_ERROR if broken else answer}]
        if not messages[-1]["content"] == answer:
            answer = str(rng.randrange(10 ** (len(answer) - 1), 10 ** len(answer)))  # a guess of as many digits
        messages.append({"role": "assistant", "content": answer})
        out.append({"messages": messages, "tools": [SCHEMA]})
    return out


def _expression(task: Task) -> str:
    return task.prompt.removeprefix("What is ").removesuffix("?")
