"""Coding and math tasks: a small bundled set, or a user's JSONL in the same format.

One JSON object per line:
  {"id": "gcd", "kind": "code", "prompt": "Write a function `gcd(a, b)` ...", "entry_point": "gcd",
   "tests": [{"args": [12, 18], "expected": 6}, ...]}
  {"id": "fib_20", "kind": "math", "prompt": "What is F(20)?", "answer": 6765}
A code task's tests are calls of its entry point and the values they must return, both plain JSON
data. Only the arguments enter the sandbox; the expected values stay with the env, which compares
them with what came back (see ``reward.py``). Math tasks are scored by the last number the model's
program prints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUNDLED = Path(__file__).with_name("tasks.jsonl")


class TaskError(ValueError):
    """A task file or line is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Call:
    args: tuple[Any, ...]
    expected: Any


@dataclass(frozen=True)
class Task:
    id: str
    kind: str
    prompt: str
    entry_point: str = ""
    tests: tuple[Call, ...] = ()
    answer: float | None = None


def _calls(obj: dict, where: str) -> tuple[Call, ...]:
    tests = obj.get("tests")
    if not isinstance(tests, list) or not tests:
        raise TaskError(f"{where}: a code task needs a non-empty list of tests in 'tests'")
    if any(isinstance(t, str) for t in tests):
        raise TaskError(f"{where}: tests are calls and expected values, e.g. "
                        '{"args": [12, 18], "expected": 6}; test expressions are not accepted, since '
                        "their expected values would run inside the sandbox")
    if not all(isinstance(t, dict) and isinstance(t.get("args"), list) and "expected" in t for t in tests):
        raise TaskError(f"{where}: every test needs a list 'args' and an 'expected' value")
    return tuple(Call(tuple(t["args"]), t["expected"]) for t in tests)


def _parse(obj: dict, where: str) -> Task:
    kind = obj.get("kind")
    if not isinstance(obj.get("id"), str) or not isinstance(obj.get("prompt"), str):
        raise TaskError(f"{where}: every task needs a string 'id' and 'prompt'")
    if kind == "code":
        entry_point = obj.get("entry_point")
        if not isinstance(entry_point, str) or not entry_point.isidentifier():
            raise TaskError(f"{where}: a code task needs the name of its function in 'entry_point'")
        return Task(obj["id"], kind, obj["prompt"], entry_point=entry_point, tests=_calls(obj, where))
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
