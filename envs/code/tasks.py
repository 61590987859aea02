"""Coding and math tasks: a small bundled set, or a user's file in the formats code-RL datasets use.

A file is JSONL (``.jsonl``, ``.json`` or any other suffix: one JSON object per line) or Parquet
(``.parquet``, read with pyarrow; one row per task, null columns ignored). Each object is one of:

- native code: ``{"id", "kind": "code", "prompt", "entry_point", "tests": [{"args": [...], "expected": ...}]}``
- native math: ``{"id", "kind": "math", "prompt", "answer": <number>}``, scored by the last number
  the model's program prints
- a stated answer: ``{"id", "kind": "answer", "prompt", "answer": <number>}``, scored by the last
  number of the model's reply, which nothing executes (a tool-use task: the model may compute it
  with the python tool first, ``envs/code/arithmetic.py``); GSM8K's ``{"question", "answer":
  "... #### 72"}`` is read as one
- native stdin/stdout: ``{"id", "kind": "stdio", "prompt", "cases": [{"input": "...", "output": "..."}]}``
- assert tests (MBPP, HumanEval-like): ``{"task_id" | "id", "text" | "prompt", "test_list" | "tests":
  ["assert f(1, 2) == 3", ...]}`` (or one string of assert lines)
- APPS / TACO: ``{"problem_id" | "id", "question" | "prompt", "input_output": {"inputs": [...],
  "outputs": [...]}}`` (an object or a JSON string); with ``fn_name`` in it, a call task
- input/output lists (CodeContests-, LiveCodeBench-like): ``{"id", "prompt", "inputs": [...],
  "outputs": [...]}``: strings are stdin/stdout cases; with ``entry_point`` (or ``fn_name``) each
  input is a list of arguments and each output the value that call returns.

Why asserts are converted, not run: a test's expected value must never be computed inside the
sandbox, where the executed code can tamper with it. So only ``assert <name>(<literals>) == <literal>``
is accepted; it becomes a :class:`Call` of plain data, and the env compares the returned value with
the expected one in its own process (see ``reward.py``). Anything else is refused, naming the file,
line and reason. Likewise a stdio case's expected stdout never enters the sandbox.

A converted code task's prompt gains the dataset's ``starter_code``, and, when it does not name
the function (MBPP's do not), its name and the first test's call (never its expected value).
MBPP's ``test_setup_code`` and ``challenge_test_list`` are ignored.

APPS call tasks sometimes wrap a single return value in a one-element list (``"outputs": [[3]]``
for a function returning ``[3]`` or ``3``); the outputs are taken as given, so such a task expects
the list. Id, prompt and name fields are looked up in the order shown (``id``, ``task_id``,
``problem_id``; ``prompt``, ``question``, ``text``); an integer id becomes a string.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUNDLED = Path(__file__).with_name("tasks.jsonl")
KINDS = ("code", "math", "stdio", "answer")
_SHOWN_CALL_CHARS = 200  # a converted task's prompt shows one call as an example, if it is this short
_TAMPER = "its expected value would have to be computed inside the sandbox, which executed code can tamper with"


class TaskError(ValueError):
    """A task file or line is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Call:
    args: tuple[Any, ...]
    expected: Any


@dataclass(frozen=True)
class IOCase:
    """One run of a stdio task: the program reads ``stdin`` and must print ``stdout``."""

    stdin: str
    stdout: str


@dataclass(frozen=True)
class Task:
    id: str
    kind: str
    prompt: str
    entry_point: str = ""
    tests: tuple[Call, ...] = ()
    answer: float | None = None
    cases: tuple[IOCase, ...] = ()


# --- values ------------------------------------------------------------------------------------


def _plain(value: Any, where: str, what: str) -> Any:
    """``value`` as plain JSON-like data (tuples become lists); anything else is refused, since the
    harness can only return plain data to compare it with."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if not math.isfinite(value):
            raise TaskError(f"{where}: {what} is a float that is not finite, which no call can return")
        return value
    if kind in (list, tuple):
        return [_plain(item, where, what) for item in value]
    if kind is dict and all(type(key) is str for key in value):
        return {key: _plain(item, where, what) for key, item in value.items()}
    raise TaskError(f"{where}: {what} is a {kind.__name__}: expected values must be plain data "
                    "(None, bool, int, float, str, list, tuple, dict with str keys)")


def _reproducible(args: tuple) -> bool:
    """Whether the sandbox can rebuild ``args`` from their repr, as the harness sends them."""
    try:
        return ast.literal_eval(repr(args)) == args
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _text(value: Any) -> str | None:
    """A stdin or stdout text: a string, or a list of lines (TACO); None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    return None


# --- assert tests ------------------------------------------------------------------------------


class _Refused(Exception):
    """One assert that cannot become a call of plain data; the message is why."""


def _literal(node: ast.expr, what: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _Refused(f"{what} is not a literal: {_TAMPER}") from None


def _one_assert(statement: ast.stmt) -> tuple[str, tuple, Any]:
    """(function name, args, expected) of ``assert name(<literals>) == <literal>``."""
    if not isinstance(statement, ast.Assert):
        raise _Refused("not an assert statement: tests are calls and expected values, e.g. "
                       '{"args": [12, 18], "expected": 6}, or `assert f(...) == value` lines; other test '
                       f"expressions are not accepted, since {_TAMPER}")
    test = statement.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        raise _Refused(f"only `assert f(...) == value` is accepted, not another comparison: {_TAMPER}")
    call = test.left
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
        raise _Refused(f"the left side must be a call of a named function: {_TAMPER}")
    if call.keywords:
        raise _Refused("keyword arguments are not accepted; pass them by position")
    args = tuple(_literal(arg, f"argument {n}") for n, arg in enumerate(call.args, start=1))
    if not _reproducible(args):
        raise _Refused("the arguments cannot be sent to the sandbox as literals")
    return call.func.id, args, _literal(test.comparators[0], "the expected value")


def _assert_calls(tests: list[str], where: str) -> tuple[str, tuple[Call, ...]]:
    """The entry point and calls of a list of assert lines (each string may hold several)."""
    name, calls = None, []
    for number, source in enumerate(tests, start=1):
        shown = source.strip().replace("\n", " ")[:80]
        try:
            statements = ast.parse(source).body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            raise TaskError(f"{where}: test {number}, `{shown}`, is not Python") from None
        for statement in statements:
            try:
                called, args, expected = _one_assert(statement)
            except _Refused as why:
                raise TaskError(f"{where}: test {number}, `{shown}`: {why}") from None
            if name is not None and called != name:
                raise TaskError(f"{where}: test {number} calls `{called}`, an earlier one `{name}`: "
                                "all asserts must call one function")
            name = called
            calls.append(Call(args, _plain(expected, where, f"the expected value of test {number}")))
    if not calls:
        raise TaskError(f"{where}: the tests hold no assert")
    return name, tuple(calls)


# --- formats -----------------------------------------------------------------------------------


def _first(obj: dict, *names: str) -> Any:
    return next((obj[name] for name in names if name in obj), None)


def _head(obj: dict, where: str) -> tuple[str, str]:
    """The task's id (an integer one as a string) and prompt."""
    task_id, prompt = _first(obj, "id", "task_id", "problem_id"), _first(obj, "prompt", "question", "text")
    if type(task_id) is int:
        task_id = str(task_id)
    if not isinstance(task_id, str) or not isinstance(prompt, str):
        raise TaskError(f"{where}: every task needs a string 'id' and 'prompt'")
    return task_id, prompt


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.isidentifier():
        raise TaskError(f"{where}: a code task needs the name of its function in 'entry_point'")
    return value


def _code_task(obj: dict, where: str, entry_point: str, calls: tuple[Call, ...]) -> Task:
    """A converted code task. Its prompt gains the starter code, if any, and the function's name and
    one call when the prompt does not name it (MBPP's do not)."""
    task_id, prompt = _head(obj, where)
    starter = obj.get("starter_code")
    if isinstance(starter, str) and starter.strip() and starter not in prompt:
        prompt = f"{prompt}\n{starter}"
    if not re.search(rf"\b{re.escape(entry_point)}\b", prompt):
        example = f"{entry_point}({', '.join(map(repr, calls[0].args))})"
        called = f" It is called as `{example}`." if len(example) <= _SHOWN_CALL_CHARS else ""
        prompt = f"{prompt}\nName the function `{entry_point}`.{called}"
    return Task(task_id, "code", prompt, entry_point=entry_point, tests=calls)


def _native_calls(tests: list, where: str) -> tuple[Call, ...]:
    if not all(isinstance(t, dict) and isinstance(t.get("args"), list) and "expected" in t for t in tests):
        raise TaskError(f"{where}: every test needs a list 'args' and an 'expected' value")
    return tuple(Call(tuple(t["args"]), t["expected"]) for t in tests)


def _tested(obj: dict, where: str) -> Task:
    """A code task from 'tests' (native calls, or assert lines) or MBPP's 'test_list'."""
    tests = _first(obj, "test_list", "tests")
    tests = [tests] if isinstance(tests, str) else tests
    if not isinstance(tests, list) or not tests:
        raise TaskError(f"{where}: a code task needs a non-empty list of tests in 'tests'")
    if not all(isinstance(t, str) for t in tests):
        task_id, prompt = _head(obj, where)
        entry_point = _name(obj.get("entry_point"), where)
        return Task(task_id, "code", prompt, entry_point=entry_point, tests=_native_calls(tests, where))
    name, calls = _assert_calls(tests, where)
    if "entry_point" in obj and obj["entry_point"] != name:
        raise TaskError(f"{where}: the asserts call `{name}`, but 'entry_point' is {obj['entry_point']!r}")
    return _code_task(obj, where, name, calls)


def _call_lists(obj: dict, where: str, inputs: list, outputs: list, name: str) -> Task:
    if not all(isinstance(args, list) for args in inputs):
        raise TaskError(f"{where}: each input of a call task (`{name}`) must be a list of its arguments")
    calls = []
    for number, (args, expected) in enumerate(zip(inputs, outputs), start=1):
        if not _reproducible(tuple(args)):
            raise TaskError(f"{where}: input {number} cannot be sent to the sandbox as literals")
        calls.append(Call(tuple(args), _plain(expected, where, f"output {number}")))
    return _code_task(obj, where, name, tuple(calls))


def _stdio_lists(obj: dict, where: str, inputs: list, outputs: list) -> Task:
    stdins, stdouts = [_text(x) for x in inputs], [_text(x) for x in outputs]
    if None in stdins or None in stdouts:
        raise TaskError(f"{where}: stdin/stdout inputs and outputs must be strings; for calls of a "
                        "function, give its name in 'entry_point' or 'fn_name' and lists of arguments")
    task_id, prompt = _head(obj, where)
    return Task(task_id, "stdio", prompt, cases=tuple(map(IOCase, stdins, stdouts)))


def _listed(obj: dict, where: str, lists: dict, name: Any, field: str) -> Task:
    """A code or stdio task from parallel 'inputs' and 'outputs' lists."""
    inputs, outputs = lists.get("inputs"), lists.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        raise TaskError(f"{where}: {field} needs non-empty lists 'inputs' and 'outputs'")
    if len(inputs) != len(outputs):
        raise TaskError(f"{where}: {field} has {len(inputs)} inputs but {len(outputs)} outputs")
    if name is not None:
        return _call_lists(obj, where, inputs, outputs, _name(name, where))
    return _stdio_lists(obj, where, inputs, outputs)


def _apps(obj: dict, where: str) -> Task:
    """APPS / TACO: 'input_output' (an object or a JSON string), a call task when it has 'fn_name'."""
    lists = obj["input_output"]
    if isinstance(lists, str):
        try:
            lists = json.loads(lists)
        except (ValueError, RecursionError):
            raise TaskError(f"{where}: 'input_output' is not JSON") from None
    if not isinstance(lists, dict):
        raise TaskError(f"{where}: 'input_output' must hold an object with 'inputs' and 'outputs'")
    return _listed(obj, where, lists, lists.get("fn_name"), "'input_output'")


def _stdio(obj: dict, where: str) -> Task:
    cases = obj.get("cases")
    if not isinstance(cases, list) or not cases:
        raise TaskError(f"{where}: a stdio task needs a non-empty list of cases in 'cases'")
    if not all(isinstance(c, dict) and _text(c.get("input")) is not None and _text(c.get("output")) is not None
               for c in cases):
        raise TaskError(f"{where}: every case needs a string 'input' and 'output'")
    task_id, prompt = _head(obj, where)
    return Task(task_id, "stdio", prompt, cases=tuple(IOCase(_text(c["input"]), _text(c["output"])) for c in cases))


def _math(obj: dict, where: str, kind: str = "math") -> Task:
    task_id, prompt = _head(obj, where)
    answer = obj.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        raise TaskError(f"{where}: a {kind} task needs a numeric 'answer'")
    return Task(task_id, kind, prompt, answer=float(answer))


_GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)\s*$")


def _gsm8k(obj: dict, where: str) -> Task:
    """GSM8K: the worked solution ends with ``#### <number>``; only the number is kept (the
    solution is never shown to the model)."""
    found = _GSM8K_ANSWER.search(obj["answer"].strip())
    if not found:
        raise TaskError(f"{where}: a GSM8K answer must end with '#### <number>'")
    obj = dict(obj, answer=float(found.group(1).replace(",", "")))
    if _first(obj, "id", "task_id", "problem_id") is None and isinstance(obj.get("question"), str):
        obj["id"] = "q-" + hashlib.sha1(obj["question"].encode()).hexdigest()[:12]  # GSM8K rows have no id
    return _math(obj, where, "answer")


def _by_fields(obj: dict, where: str) -> Task | None:
    """A code or stdio task told by its test fields, or None when it has none."""
    if "cases" in obj:
        return _stdio(obj, where)
    if "input_output" in obj:
        return _apps(obj, where)
    if "inputs" in obj or "outputs" in obj:
        return _listed(obj, where, obj, _first(obj, "entry_point", "fn_name"), "the task")
    if "test_list" in obj or "tests" in obj:
        return _tested(obj, where)
    return None


def _parse(obj: Any, where: str) -> Task:
    if not isinstance(obj, dict):
        raise TaskError(f"{where}: a task is a JSON object, not {type(obj).__name__}")
    obj = {key: value for key, value in obj.items() if value is not None}  # Parquet's empty columns
    kind = obj.get("kind")
    if kind is not None and kind not in KINDS:
        raise TaskError(f"{where}: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind in ("math", "answer"):
        if isinstance(obj.get("answer"), str) and "####" in obj["answer"]:
            return _gsm8k(obj, where)
        return _math(obj, where, kind)
    if kind is None and isinstance(obj.get("answer"), str) and "####" in obj["answer"]:
        return _gsm8k(obj, where)
    task = _by_fields(obj, where)
    if task is None:
        if kind == "code":
            return _tested(obj, where)  # says what it lacks
        raise TaskError(f"{where}: no tests: give 'kind' ('code', 'math' or 'stdio'), or assert lines in "
                        "'tests' or 'test_list', or 'input_output', or 'inputs' and 'outputs'")
    if kind is not None and task.kind != kind:
        raise TaskError(f"{where}: 'kind' is {kind!r}, but its tests make it a {task.kind} task")
    return task


# --- files -------------------------------------------------------------------------------------


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    number = 0
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise TaskError(f"{path}:{number}: not JSON ({err.msg})") from None
                except RecursionError:
                    raise TaskError(f"{path}:{number}: not JSON (nested too deeply)") from None
                yield f"{path}:{number}", obj
    except UnicodeDecodeError:
        raise TaskError(f"{path}:{number + 1}: not UTF-8 text") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise TaskError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (OSError, pyarrow.ArrowException) as err:
        raise TaskError(f"{path}: not a readable Parquet file ({err})") from None
    for number, row in enumerate(rows, start=1):
        yield f"{path}:row {number}", row


def load_tasks(path: str | Path = BUNDLED) -> list[Task]:
    """Every task of a JSONL or Parquet file (by its suffix), checked; raises :class:`TaskError`."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"task file {path} does not exist")
    rows = _parquet_rows(path) if path.suffix.lower() == ".parquet" else _jsonl_rows(path)
    tasks, seen = [], {}
    for where, obj in rows:
        task = _parse(obj, where)
        if task.id in seen:
            raise TaskError(f"{where}: repeats a task id, {task.id!r}, first at {seen[task.id]}")
        seen[task.id] = where
        tasks.append(task)
    if not tasks:
        raise TaskError(f"task file {path} has no tasks")
    return tasks
