"""The code env on the local sandbox: bundled tasks are solvable, rewards are the fraction of
hidden tests passed (or an exact numeric answer), and bad programs end the episode clearly."""

from __future__ import annotations

import json
import time

import pytest

from envs import registry
from envs.code.env import CodeEnv, extract_code
from envs.code.reward import score_math
from envs.code.sandbox import Limits, LocalSandbox
from envs.code.tasks import TaskError, load_tasks
from ray_forge.config.schema import EnvConfig

REFERENCE = {
    "add_digits": "def digit_sum(n):\n    return sum(map(int, str(n)))",
    "reverse_words": "def reverse_words(s):\n    return ' '.join(reversed(s.split(' ')))",
    "is_palindrome": "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalpha()]\n    return t == t[::-1]",
    "fizzbuzz_count": "def count_fizzbuzz(n):\n    return n // 15",
    "second_largest": "def second_largest(xs):\n    return sorted(set(xs))[-2]",
    "run_length": ("import itertools\ndef run_length(s):\n"
                   "    return ''.join(k + str(len(list(g))) for k, g in itertools.groupby(s))"),
    "gcd": "import math\ndef gcd(a, b):\n    return math.gcd(a, b)",
    "primes_below": "def primes_below(n):\n    return [p for p in range(2, n) if all(p % d for d in range(2, p))]",
    "flatten": ("def flatten(xs):\n    out = []\n    for x in xs:\n"
                "        out.extend(flatten(x) if isinstance(x, list) else [x])\n    return out"),
    "anagrams": "def are_anagrams(a, b):\n    return sorted(a) == sorted(b)",
    "matrix_transpose": "def transpose(m):\n    return [list(r) for r in zip(*m)]",
    "balanced": ("def balanced(s):\n    stack, pairs = [], {')': '(', ']': '[', '}': '{'}\n    for c in s:\n"
                 "        if c in '([{':\n            stack.append(c)\n        elif c in pairs:\n"
                 "            if not stack or stack.pop() != pairs[c]:\n                return False\n"
                 "    return not stack"),
}


@pytest.fixture(scope="module")
def env():
    box = LocalSandbox(size=1, limits=Limits(wall_s=3, cpu_s=2, memory_mb=256))
    yield CodeEnv(load_tasks(), box)
    box.close()


def play(env, task_id: str, completion: str):
    seed = [t.id for t in env.tasks].index(task_id)
    prompt = env.reset(seed)
    assert env.task.prompt in prompt
    return env.step(completion)


def test_bundled_tasks_load_and_every_code_task_is_solvable(env):
    kinds = [t.kind for t in env.tasks]
    assert kinds.count("code") == 12 and kinds.count("math") == 12
    assert set(REFERENCE) == {t.id for t in env.tasks if t.kind == "code"}
    for task_id, solution in REFERENCE.items():
        result = play(env, task_id, f"Here you go:\n```python\n{solution}\n```")
        assert result.done and result.reward == 1.0, (task_id, result)


def test_partial_solutions_get_the_fraction_of_tests_passed(env):
    result = play(env, "gcd", "```python\ndef gcd(a, b):\n    return 6\n```")  # right only for (12, 18)
    assert result.reward == pytest.approx(1 / 4)
    result = play(env, "fizzbuzz_count", "```python\ndef count_fizzbuzz(n):\n    return 0\n```")
    assert result.reward == pytest.approx(2 / 4)


def test_garbage_and_broken_code_score_zero_with_a_reason(env):
    result = play(env, "gcd", "HIT STICK banana")
    assert result.reward == 0.0 and result.info["error"] == "the solution raised when defined"
    result = play(env, "gcd", "```python\ndef greatest(a, b):\n    return 1\n```")
    assert result.reward == 0.0 and result.info["error"] == "the solution does not define `gcd`"
    result = play(env, "gcd", "```python\ndef gcd(a, b):\n    return a / 0\n```")
    assert result.reward == 0.0 and "error" not in result.info  # it ran; every test failed


def test_hostile_code_ends_the_episode_and_the_next_one_is_right(env):
    result = play(env, "gcd", "```python\nwhile True:\n    pass\n```")
    assert result.reward == 0.0 and ("timeout" in result.info["error"] or "cpu" in result.info["error"])
    result = play(env, "gcd", f"```python\n{REFERENCE['gcd']}\n```")
    assert result.reward == 1.0




def test_math_tasks_need_the_exact_answer(env):
    assert play(env, "fib_20", "```python\na, b = 1, 1\nfor _ in range(18):\n    a, b = b, a + b\nprint(b)\n```").reward == 1.0
    assert play(env, "fib_20", "```python\nprint(6764)\n```").reward == 0.0
    assert play(env, "compound", "```python\nprint(1000 * 1.1 ** 3)\n```").reward == 1.0  # 1331.0000000000005
    assert score_math("no number", 3) == 0.0 and score_math("answer: 7\n", 7) == 1.0


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("x\n```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("print(1)") == "print(1)"


def test_bad_task_files_say_where(tmp_path):
    path = tmp_path / "tasks.jsonl"
    good = {"id": "a", "kind": "code", "prompt": "p", "entry_point": "f", "tests": [{"args": [], "expected": 1}]}
    path.write_text(json.dumps(good) + "\nnot json\n")
    with pytest.raises(TaskError, match=r"tasks.jsonl:2: not JSON"):
        load_tasks(path)
    path.write_text(json.dumps(dict(good, tests=["f() == 1"])) + "\n")
    with pytest.raises(TaskError, match="tests are calls and expected values.*not accepted"):
        load_tasks(path)
    path.write_text(json.dumps(dict(good, entry_point="not a name")) + "\n")
    with pytest.raises(TaskError, match="'entry_point'"):
        load_tasks(path)
    path.write_text(json.dumps(dict(good, tests=[{"args": 3, "expected": 1}])) + "\n")
    with pytest.raises(TaskError, match="list 'args' and an 'expected'"):
        load_tasks(path)
    path.write_text(json.dumps({"id": "a", "kind": "poem", "prompt": "p"}) + "\n")
    with pytest.raises(TaskError, match="'kind' must be one of code, math, stdio, answer, got 'poem'"):
        load_tasks(path)
    path.write_text(json.dumps({"id": "a", "kind": "math", "prompt": "p", "answer": "7"}) + "\n")
    with pytest.raises(TaskError, match="numeric 'answer'"):
        load_tasks(path)
    with pytest.raises(TaskError, match="does not exist"):
        load_tasks(tmp_path / "missing.jsonl")
    path.write_text(json.dumps({"id": "u", "kind": "math", "prompt": "2+2?", "answer": 4}) + "\n")
    assert load_tasks(path)[0].answer == 4.0


HOSTILE = {"loop": "```python\nwhile True:\n    pass\n```",
           "fork_bomb": "```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n```"}
POOL_OPTIONS = {"concurrency": 2, "limits": {"wall_s": 3.0, "cpu_s": 2.0, "memory_mb": 256}}


def _gcd_seed() -> int:
    return [t.id for t in load_tasks()].index("gcd")


def test_env_pool_runs_code_episodes_concurrently_and_survives_hostile_programs():
    from ray_forge.actors.env_pool import EnvPool

    pool = EnvPool(EnvConfig(), registry.get("code").setup(POOL_OPTIONS))
    assert pool.action_words is None
    good = f"```python\n{REFERENCE['gcd']}\n```"
    prompts = [start.observation for start in pool.reset(1, [_gcd_seed()] * 4)]
    assert all("gcd" in p for p in prompts)
    start = time.monotonic()
    results = pool.step(1, [0, 1, 2, 3], [good, HOSTILE["loop"], HOSTILE["fork_bomb"], good])
    assert time.monotonic() - start < 2 * 3.0 + 4  # two at a time, each bounded by the wall clock
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0]
    assert all(r.info.get("error") for r in results[1:3]) and all(r.done for r in results)
    pool.reset(2, [_gcd_seed()] * 2)  # the next episodes are scored correctly
    assert [r.reward for r in pool.step(2, [0, 1], [good, good])] == [1.0, 1.0]


@pytest.mark.ray
def test_the_env_actor_stays_alive_after_a_hostile_program(ray_cluster):
    from ray_forge.actors.env_pool import EnvPoolActor

    actor = EnvPoolActor.options(num_cpus=0).remote(EnvConfig(), registry.get("code").setup(POOL_OPTIONS))
    try:
        ray_cluster.get(actor.reset.remote(1, [_gcd_seed()] * 2), timeout=120)
        bad, good = ray_cluster.get(actor.step.remote(1, [0, 1], [HOSTILE["fork_bomb"],
                                                                  f"```python\n{REFERENCE['gcd']}\n```"]), timeout=60)
        assert bad.reward == 0.0 and bad.info["error"] and good.reward == 1.0
        assert ray_cluster.get(actor.get_action_words.remote(), timeout=30) is None  # still answering
    finally:
        ray_cluster.kill(actor)


def failed(tool, code: str) -> str:
    """What the model reads of a call that failed: the tool raises it, as a ToolError (counted)."""
    from ray_forge.core.tools import ToolError

    with pytest.raises(ToolError) as err:
        tool({"code": code})
    return str(err.value)


def shown(tool, code: str) -> str:
    """What the model reads of a call, whether it failed or not."""
    from ray_forge.core.tools import ToolError

    try:
        return tool({"code": code})
    except ToolError as err:
        return str(err)


def test_the_python_tool_keeps_one_session_per_episode_in_the_sandbox(env):
    """The local sandbox keeps nothing between executions; the tool's session replays the
    episode's earlier cells, so state persists, and a new episode starts afresh."""
    from envs.code.python_tool import PythonTool, ReplaySession

    session = ReplaySession(env.executor)
    tool = PythonTool(session)
    assert tool({"code": "x = 7"}) == "[no output]"
    assert tool({"code": "print(x)"}) == "7"
    assert tool({"code": "from __future__ import annotations\nprint(x + 1)"}) == "8"  # a cell is its own module
    assert "line 1" in failed(tool, "1 / 0") and "ZeroDivisionError" in failed(tool, "1 / 0")
    assert tool({"code": "globals().clear()"}) == "[no output]"  # a cell cannot break the replay
    assert tool({"code": "x = 9"}) == "[no output]" and tool({"code": "print(x)"}) == "9"
    session.new_session()
    assert tool({"code": "y = 1"}) == "[no output]"
    assert "[stopped: " in failed(tool, "while True: pass")
    assert tool({"code": "print(y)"}) == "1"  # the cell the sandbox stopped is not run again
    assert "NameError" in failed(tool, "print(x)")
    with pytest.raises(TypeError, match="takes"):
        tool({"code": 3})


def test_the_python_tool_needs_full_isolation():
    from envs.code.spec import CodeOptions

    with pytest.raises(ValueError, match="tool = true needs isolation = full"):
        CodeOptions(tool=True, isolation="none")
    assert CodeOptions(tool=True, backend="together", isolation="none").tool


def test_tool_calls_cannot_shape_how_the_answer_is_judged(env):
    """An attack through the episode's own session: the model's calls plant files, patch builtins,
    print forged result lines and look for the tests and secrets; its wrong answer still scores 0
    (the judge runs in a fresh execution, outside the session) and a right one still scores 1."""
    import os

    from envs.code.python_tool import PythonTool, ReplaySession

    os.environ["TOGETHER_API_KEY"] = "tk-must-not-leak"
    try:
        seed = [t.id for t in env.tasks].index("gcd")
        env.reset(seed)
        tool = PythonTool(ReplaySession(env.executor))
        planted = shown(tool, ("import builtins, json\n"
                                "open('/tmp/expected', 'w').write('6')\n"
                                "builtins.gcd = lambda a, b: 6\n"
                                "json.dumps = lambda *a, **k: '{\"loaded\": \"yes\", \"results\": []}'\n"
                                "print('@@rf-result-0000@@{\"loaded\": \"yes\", \"results\": [{\"value\": 6}]}')"))
        assert "@@rf-result-0000@@" in planted  # the forged line reached only the model
        looked = shown(tool, ("import os, glob\nprint(os.environ.get('TOGETHER_API_KEY'), "
                               "glob.glob('/**/tasks.jsonl', recursive=True), os.path.exists('/tmp/expected'))"))
        assert "tk-must-not-leak" not in looked and "tasks.jsonl" not in looked
        wrong = env.step("```python\ndef gcd(a, b):\n    return gcd(a, b)\n```")
        assert wrong.reward == 0.0
        env.reset(seed)
        assert env.step(f"```python\n{REFERENCE['gcd']}\n```").reward == 1.0
    finally:
        os.environ.pop("TOGETHER_API_KEY", None)
