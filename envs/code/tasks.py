"""Coding and math tasks: a small bundled set, or a user's JSONL in the same format.

One JSON object per line:
  {"id": "gcd", "kind": "code", "prompt": "Write a function `gcd(a, b)` ...", "tests": ["gcd(12, 18) == 6", ...]}
  {"id": "fib_20", "kind": "math", "prompt": "What is F(20)?", "answer": 6765}
Code tasks are scored by the fraction of hidden test expressions that hold; math tasks by an
exact numeric answer printed by the model's program.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BUNDLED = Path(__file__).with_name("tasks.jsonl")


class TaskError(ValueError):
    """A task file or line is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Task:
    id: str
    kind: str
    prompt: str
    tests: tuple[str, ...] = ()
    answer: float | None = None


def _parse(obj: dict, where: str) -> Task:
    kind = obj.get("kind")
    if not isinstance(obj.get("id"), str) or not isinstance(obj.get("prompt"), str):
        raise TaskError(f"{where}: every task needs a string 'id' and 'prompt'")
    if kind == "code":
        tests = obj.get("tests")
        if not tests or not all(isinstance(t, str) for t in tests):
            raise TaskError(f"{where}: a code task needs a non-empty list of test expressions in 'tests'")
        return Task(obj["id"], kind, obj["prompt"], tests=tuple(tests))
    if kind == "math":
        answer = obj.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (int, float)):
            raise TaskError(f"{where}: a math task needs a numeric 'answer'")
        return Task(obj["id"], kind, obj["prompt"], answer=float(answer))
    raise TaskError(f"{where}: 'kind' must be 'code' or 'math', got {kind!r}")


def load_tasks(path: str | Path = BUNDLED) -> list[Task]:
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"task file {path} does not exist")
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskError(f"{path}:{number}: not JSON ({err.msg})") from None
        tasks.append(_parse(obj, f"{path}:{number}"))
    if not tasks:
        raise TaskError(f"task file {path} has no tasks")
    if len({t.id for t in tasks}) != len(tasks):
        raise TaskError(f"task file {path} repeats a task id")
    return tasks
