"""Task files in the formats code-RL datasets come in (assert tests, stdin/stdout cases, call
lists; JSONL or Parquet), and judge(): stdio tasks scored outside the sandbox, code and math tasks
scored as CodeEnv scores them."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

from envs.code.env import CodeEnv, extract_code
from envs.code.reward import MAX_CASES, judge, same_output, stdin_program
from envs.code.sandbox import ExecResult, Limits, LocalSandbox
from envs.code.tasks import Call, IOCase, Task, TaskError, load_tasks


@pytest.fixture(scope="module")
def box():
    sandbox = LocalSandbox(size=1, limits=Limits(wall_s=3, cpu_s=2, memory_mb=256), isolation="none")
    yield sandbox
    sandbox.close()


class Recorder:
    """An executor that runs nothing: it keeps each program and answers with ``result``."""

    def __init__(self, result: ExecResult) -> None:
        self.result, self.programs = result, []

    def execute(self, code: str) -> ExecResult:
        self.programs.append(code)
        return self.result

    def new_session(self) -> None:
        return None


def write(tmp_path, *rows, name="tasks.jsonl"):
    path = tmp_path / name
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def loaded(tmp_path, *rows) -> list[Task]:
    return load_tasks(write(tmp_path, *rows))


MBPP = {"task_id": 2, "text": "Write a function to find the shared elements of two tuples.",
        "test_list": ["assert similar((3, 4, 5), (5, 4, 10)) == (4, 5)",
                      "assert similar((1, 2), (3,)) == ()", "assert similar(('a', -1.5), ('a',)) == ('a',)"],
        "test_setup_code": "", "challenge_test_list": []}
GOOD_CODE = {"id": "a", "kind": "code", "prompt": "p", "entry_point": "f", "tests": [{"args": [1], "expected": 2}]}


# --- assert tests ---------------------------------------------------------------------------------


def test_mbpp_and_humaneval_asserts_become_calls_and_expected_values(tmp_path):
    humaneval = {"id": "HumanEval/1", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n", "entry_point": "add",
                 "tests": "assert add(1, 2) == 3\n\nassert add(-1, 1) == 0\nassert add([1], [2]) == [1, 2]\n"}
    mbpp, human = loaded(tmp_path, MBPP, humaneval)
    assert (mbpp.id, mbpp.kind, mbpp.entry_point) == ("2", "code", "similar")
    assert mbpp.tests == (Call(((3, 4, 5), (5, 4, 10)), [4, 5]), Call(((1, 2), (3,)), []),
                          Call((("a", -1.5), ("a",)), ["a"]))
    assert mbpp.prompt.startswith(MBPP["text"]) and "`similar((3, 4, 5), (5, 4, 10))`" in mbpp.prompt
    assert human.tests == (Call((1, 2), 3), Call((-1, 1), 0), Call(([1], [2]), [1, 2]))
    assert human.prompt == humaneval["prompt"]  # it names its function already


@pytest.mark.parametrize("test, reason", [
    ("assert f(1) != 3", "not another comparison: its expected value would have to be computed inside the sandbox"),
    ("assert abs(f(1) - 2) < 1e-6", "not another comparison"),
    ("assert f(g(1)) == 2", "argument 1 is not a literal: its expected value would have to be computed inside"),
    ("assert f(1, x) == 2", "argument 2 is not a literal"),
    ("assert f(1) == g(2)", "the expected value is not a literal"),
    ("assert f.g(1) == 2", "the left side must be a call of a named function"),
    ("assert f(n=1) == 2", "keyword arguments are not accepted"),
    ("assert f(1) == {1, 2}", "is a set: expected values must be plain data"),
    ("assert f(1) == b'x'", "is a bytes"),
    ("assert f(1) == 1j", "is a complex"),
    ("assert f(1) == {1: 2}", "is a dict"),
    ("f(1) == 2", "not an assert statement"),
    ("assert f(1) == 2\nassert g(1) == 2", "all asserts must call one function"),
    ("assert f(1) = = 2", "is not Python"),
])
def test_asserts_that_are_not_literal_calls_are_refused_with_file_line_and_reason(tmp_path, test, reason):
    with pytest.raises(TaskError, match=rf"tasks\.jsonl:2: .*{reason}"):
        loaded(tmp_path, MBPP, {"task_id": 3, "text": "t", "test_list": [test]})


def test_an_entry_point_must_match_the_asserts(tmp_path):
    with pytest.raises(TaskError, match=r"tasks\.jsonl:1: the asserts call `similar`, but 'entry_point' is 'other'"):
        loaded(tmp_path, dict(MBPP, entry_point="other"))


# --- stdin/stdout and call lists ------------------------------------------------------------------


def test_stdio_tasks_load_from_apps_plain_lists_and_native_cases(tmp_path):
    apps = {"problem_id": 7, "question": "Add two numbers.",
            "input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})}
    taco = {"id": "taco", "question": "q", "input_output": {"inputs": [["1", "2"]], "outputs": [["3", "4"]]}}
    contests = {"id": "cc", "prompt": "p", "inputs": ["5\n"], "outputs": ["25\n"]}
    native = {"id": "n", "kind": "stdio", "prompt": "p", "cases": [{"input": "", "output": "hi"}]}
    tasks = loaded(tmp_path, apps, taco, contests, native)
    assert [t.kind for t in tasks] == ["stdio"] * 4
    assert tasks[0].id == "7" and tasks[0].cases == (IOCase("1 2\n", "3\n"), IOCase("3 4\n", "7\n"))
    assert tasks[1].cases == (IOCase("1\n2", "3\n4"),)  # TACO's lists of lines
    assert tasks[2].cases == (IOCase("5\n", "25\n"),) and tasks[3].cases == (IOCase("", "hi"),)


def test_apps_fn_name_and_call_lists_become_code_tasks(tmp_path):
    apps = {"problem_id": 9, "question": "Sum a list.", "starter_code": "def total(xs):",
            "input_output": json.dumps({"fn_name": "total", "inputs": [[[1, 2]], [[]]], "outputs": [[3], [0]]})}
    lists = {"id": "sq", "prompt": "Write square(x).", "fn_name": "square", "inputs": [[2], [-3]], "outputs": [4, 9]}
    apps_task, lists_task = loaded(tmp_path, apps, lists)
    assert (apps_task.kind, apps_task.entry_point) == ("code", "total")
    assert apps_task.tests == (Call(([1, 2],), [3]), Call(([],), [0]))  # APPS's one-element lists, as given
    assert apps_task.prompt == "Sum a list.\ndef total(xs):"
    assert lists_task.tests == (Call((2,), 4), Call((-3,), 9)) and lists_task.prompt == "Write square(x)."


@pytest.mark.parametrize("row, reason", [
    ({"inputs": ["1"], "outputs": ["1", "2"]}, "1 inputs but 2 outputs"),
    ({"inputs": [], "outputs": []}, "non-empty lists 'inputs' and 'outputs'"),
    ({"inputs": [[1]], "outputs": [1]}, "must be strings; for calls of a function, give its name"),
    ({"entry_point": "f", "inputs": ["1"], "outputs": [1]}, "must be a list of its arguments"),
    ({"entry_point": "f", "inputs": [[1]], "outputs": [float("nan")]}, "not finite"),
    ({"input_output": "{not json"}, "'input_output' is not JSON"),
    ({"input_output": json.dumps({"inputs": ["1"]})}, "non-empty lists"),
    ({"kind": "code", "inputs": ["1"], "outputs": ["2"]}, "'kind' is 'code', but its tests make it a stdio task"),
    ({"kind": "stdio", "cases": [{"input": 1, "output": "2"}]}, "string 'input' and 'output'"),
    ({}, "no tests: give 'kind'"),
])
def test_bad_io_rows_are_refused_naming_file_and_line(tmp_path, row, reason):
    with pytest.raises(TaskError, match=rf"tasks\.jsonl:2: .*{reason}"):
        loaded(tmp_path, GOOD_CODE, dict({"id": "b", "prompt": "p"}, **row))


def test_malformed_lines_and_repeated_ids_are_refused_naming_file_and_line(tmp_path):
    with pytest.raises(TaskError, match=r"tasks\.jsonl:3: not JSON"):
        loaded(tmp_path, GOOD_CODE, "", "{oops")
    with pytest.raises(TaskError, match=r"tasks\.jsonl:2: a task is a JSON object, not list"):
        loaded(tmp_path, GOOD_CODE, "[1, 2]")
    with pytest.raises(TaskError, match=r"tasks\.jsonl:2: repeats a task id, '2', first at .*tasks\.jsonl:1"):
        loaded(tmp_path, MBPP, dict(GOOD_CODE, id="2"))  # MBPP's integer id is the string "2"
    with pytest.raises(TaskError, match="has no tasks"):
        loaded(tmp_path, "")


# --- Parquet ----------------------------------------------------------------------------------------


def test_parquet_files_load_and_a_bad_row_is_named(tmp_path, monkeypatch):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    apps = {"problem_id": 4, "question": "q", "input_output": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})}
    path = tmp_path / "tasks.parquet"

    def table(*rows):  # every row has every column, null where it had none
        columns = sorted({key for row in rows for key in row})
        return pyarrow.Table.from_pylist([{key: row.get(key) for key in columns} for row in rows])

    pyarrow.parquet.write_table(table(MBPP, apps), path)
    mbpp, stdio = load_tasks(path)
    assert mbpp.kind == "code" and mbpp.tests[0] == Call(((3, 4, 5), (5, 4, 10)), [4, 5])
    assert stdio.kind == "stdio" and stdio.cases == (IOCase("1\n", "1\n"),)
    bad = dict(MBPP, task_id=5, test_list=["assert similar(1) == 2", "assert similar(x) == 2"])
    pyarrow.parquet.write_table(table(MBPP, bad), path)
    with pytest.raises(TaskError, match=r"tasks\.parquet:row 2: test 2, `assert similar\(x\) == 2`: argument 1"):
        load_tasks(path)
    path.write_bytes(b"not parquet")
    with pytest.raises(TaskError, match=r"tasks\.parquet: not a readable Parquet file"):
        load_tasks(path)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(TaskError, match="pip install pyarrow"):
        load_tasks(path)


def test_ten_thousand_tasks_of_mixed_formats_load_in_seconds(tmp_path):
    def row(n: int) -> dict:
        return [dict(MBPP, task_id=n),
                {"problem_id": f"p{n}", "question": "q", "input_output": json.dumps(
                    {"inputs": [f"{n}\n", "2\n"], "outputs": [f"{n}\n", "2\n"]})},
                {"id": f"c{n}", "prompt": "p", "entry_point": "f", "inputs": [[n, [1, 2]]], "outputs": [[n]]},
                dict(GOOD_CODE, id=f"g{n}"),
                {"id": f"m{n}", "kind": "math", "prompt": "p", "answer": n}][n % 5]

    path = write(tmp_path, *map(row, range(10_000)))
    start = time.perf_counter()
    tasks = load_tasks(path)
    seconds = time.perf_counter() - start
    assert len(tasks) == 10_000 and {t.kind for t in tasks} == {"code", "stdio", "math"}
    assert seconds < 20, f"10,000 tasks took {seconds:.1f}s"


# --- judging stdio tasks ----------------------------------------------------------------------------

ADD = Task("add", "stdio", "Print the sum of two numbers.",
           cases=(IOCase("1 2\n", "3\n"), IOCase("0.1 0.2\n", "0.3\n"), IOCase("10 -4\n", "6\n")))
RIGHT = ("import sys\na, b = map(float, sys.stdin.buffer.readline().split())\n"
         "s = a + b\nprint(int(s) if s.is_integer() else s, '  ')\nprint()\n\n")  # 0.30000000000000004, padded


def test_judge_scores_stdio_by_the_fraction_of_cases_printed_right(box):
    reward, info = judge(ADD, RIGHT, box)
    assert reward == 1.0 and info["passed"] == 3 and "error" not in info, info
    reward, info = judge(ADD, "print('nope')", box)
    assert reward == 0.0 and info["error"] == "case 1: wrong output" and not info.get("execution_failed")
    reward, info = judge(ADD, "if __name__ == '__main__':\n    print(3)", box)  # right for the first case only
    assert reward == pytest.approx(1 / 3) and info["error"] == "case 2: wrong output"
    reward, info = judge(ADD, "a, b = map(int, input().split())\nprint(a + b)", box)  # raises on "0.1"
    assert reward == pytest.approx(2 / 3) and "exited with status 1" in info["error"] and "ValueError" in info["stderr"]
    reward, info = judge(ADD, "def (", box)
    assert reward == 0.0 and info["error"] == "case 1: the solution does not compile" and info["passed"] == 0


def test_output_comparison_tolerates_whitespace_and_float_rounding_only():
    assert same_output("1  2 \n3\n\n\n", "1 2\n3")
    assert same_output("0.30000000000000004\n", "0.3") and same_output("1e-12", "0")
    assert not same_output("1000001", "1000000")  # integers compare exactly
    assert not same_output("0.3001", "0.3") and not same_output("1 2", "1\n2") and not same_output("YES", "yes")
    assert not same_output("3\n4", "3") and not same_output("", "3")


def test_a_program_cannot_forge_stdout_it_never_saw(box):
    task = Task("secret", "stdio", "p", cases=(IOCase("7\n", "SECRET-7\n"),))
    # Reads its stdin, looks for the expected text in every object and frame it can reach, else guesses.
    guesser = ("import gc, re, sys\ndata = sys.stdin.read()\n"
               "def items(o):\n    if isinstance(o, dict):\n        return list(o.values())\n"
               "    return list(o) if isinstance(o, (list, tuple)) else []\n"
               "frame, frames = sys._getframe(), []\n"
               "while frame:\n    frames.append(frame.f_globals)\n    frame = frame.f_back\n"
               "found = [s for o in gc.get_objects() + frames for s in items(o)\n"
               "         if isinstance(s, str) and re.fullmatch(r'SECRET-[0-9]+\\s*', s)]\n"
               "print(found[0].strip() if found else 'SECRET-' + str(int(data) + 1))")
    planted = box.execute("_leak = {'expected': 'SECRET-7\\n'}\n" + stdin_program(guesser, "7\n"))
    assert planted.stdout == "SECRET-7\n", planted  # it would find the expected text, were it there
    assert judge(task, guesser, box) == (0.0, {"task": "secret", "stderr": "", "stdout": "SECRET-8\n", "cases": 1,
                                              "passed": 0, "error": "case 1: wrong output"})
    assert judge(task, "print('SECRET-' + input())", box)[0] == 1.0


def test_stdio_judgement_is_capped_stops_at_the_first_sandbox_stop_and_keeps_expected_text_outside():
    task = Task("many", "stdio", "p", cases=tuple(IOCase(f"{n}\n", f"expected-{n}\n") for n in range(40)))
    ran = Recorder(ExecResult("expected-0\n", "", 0, None, 0.01))
    reward, info = judge(task, "print(1)", ran)
    assert len(ran.programs) == MAX_CASES and info["cases"] == MAX_CASES and reward == pytest.approx(1 / MAX_CASES)
    assert not any("expected-" in program for program in ran.programs)
    stopped = Recorder(ExecResult("", "", None, "timeout: still running after 3s", 3.0))
    reward, info = judge(task, "while True: pass", stopped)
    assert len(stopped.programs) == 1 and reward == 0.0
    assert info["execution_failed"] and info["error"] == "case 1: timeout: still running after 3s"


# --- judging code and math tasks as CodeEnv does ----------------------------------------------------------


def unmarked(stdout: str) -> str:
    """``stdout`` with the harness's random result marker made one constant."""
    return re.sub(r"@@rf-result-[0-9a-f]{16}@@", "@@rf-result@@", stdout)


def test_judge_scores_code_and_math_tasks_as_code_env_does(box):
    """judge()'s reward, info and stdout, with execution_failed mapped to the error reward, are what
    CodeEnv.step gives today."""
    env = CodeEnv(load_tasks(), box, error_reward=-0.5)
    by_id = {task.id: task for task in env.tasks}
    plays = [("gcd", "```python\nimport math\ndef gcd(a, b):\n    return math.gcd(a, b)\n```", 1.0),
             ("gcd", "```python\ndef gcd(a, b):\n    return 6\n```", 0.25),
             ("gcd", "HIT STICK banana", 0.0),
             ("gcd", "```python\ndef greatest(a, b):\n    return 1\n```", 0.0),
             ("gcd", "```python\nimport os\nos._exit(0)\n```", -0.5),  # its calls never reported
             ("fib_20", "```python\nprint(6765)\n```", 1.0),
             ("fib_20", "```python\nprint(6764)\n```", 0.0)]
    for task_id, completion, expected in plays:
        env.reset([t.id for t in env.tasks].index(task_id))
        step = env.step(completion)
        reward, info = judge(by_id[task_id], extract_code(completion), box)
        observation = info.pop("stdout")
        if info.pop("execution_failed", False):
            reward = env.error_reward
        assert (reward, info, unmarked(observation)) == (step.reward, step.info, unmarked(step.observation)), task_id
        assert reward == expected, task_id
    stopped = Recorder(ExecResult("", "", None, "timeout: still running after 3s", 3.0))
    for task_id in ("gcd", "fib_20"):
        reward, info = judge(by_id[task_id], "while True: pass", stopped)
        assert reward == 0.0 and info["execution_failed"] and info["error"].startswith("timeout")
