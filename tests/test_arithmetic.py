"""The tool task family: seeded, disjoint splits; a stated answer judged exactly, outside the
sandbox, which the code env's reward forgeries cannot fool; the warm start's demonstrations."""

from __future__ import annotations

import json

import pytest

from envs.code.arithmetic import Arithmetic, Mix, demonstrations
from envs import registry
from envs.code.env import CodeEnv, show
from envs.code.python_tool import PythonTool, ReplaySession
from envs.code.sandbox import Limits, LocalSandbox
from envs.code.tasks import load_tasks
from forgeries import FORGERIES, forged
from ray_forge.config import load_config
from ray_forge.config.schema import JobConfig, ToolConfig
from ray_forge.core.chat import ToolCall
from ray_forge.core.tools import ToolRunner, ToolStats


def test_splits_are_seeded_and_disjoint():
    train, held_out = Arithmetic(train=500, held_out=100, seed=3).splits()
    assert len(train) == 500 and len(held_out) == 100
    assert not {t.id for t in train} & {t.id for t in held_out}
    assert Arithmetic(train=500, held_out=100, seed=3).splits() == (train, held_out)
    assert Arithmetic(train=500, held_out=100, seed=4).splits()[0] != train
    a, b, c = (int(x) for x in train[0].id.replace("*", " ").replace("+", " ").split())
    assert train[0].answer == a * b + c and 1000 <= a <= 9999 and 100 <= b <= 999


def test_too_many_questions_for_the_digits_are_refused():
    with pytest.raises(ValueError, match="would repeat"):
        Arithmetic(train=5000, digits=(1, 1))


@pytest.fixture(scope="module")
def sandbox():
    with LocalSandbox(size=1, limits=Limits(wall_s=5, cpu_s=4, memory_mb=256, output_bytes=16 * 1024)) as box:
        yield box


@pytest.fixture
def env(sandbox):
    train, held_out = Arithmetic(train=20, held_out=5).splits()
    return CodeEnv(train, sandbox, session=ReplaySession(sandbox), held_out=held_out)


def test_a_stated_answer_is_judged_exactly(env):
    env.reset(0)
    answer = int(env.tasks[0].answer)
    assert env.step(f"{answer}").reward == 1.0
    env.reset(0)
    assert env.step(f"It is {answer}.").reward == 1.0
    env.reset(0)
    assert env.step(f"{answer + 3}").reward == 0.0  # within 1e-6 relative of 7 digits: still wrong
    env.reset(0)
    assert env.step(f"{answer} or maybe {answer + 1}").reward == 0.0  # the last number is the answer
    env.reset(0)
    result = env.step("I cannot say.")
    assert result.reward == 0.0 and result.info["error"] == "the reply states no number"


def test_a_negative_seed_shows_a_held_out_question(env):
    assert env.reset(-1).startswith(env.held_out[0].prompt)
    assert env.reset(-2).startswith(env.held_out[1].prompt)
    assert env.reset(0).startswith(env.tasks[0].prompt)


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_the_code_envs_forgeries_score_nothing_here(env, kind):
    """As the reply, and run through the episode's tool session first: the reply is never
    executed, and what a program printed is only ever read by the model."""
    tool = PythonTool(env.session)
    for seed in (0, -1):
        env.reset(seed)
        try:
            tool({"code": forged(kind, "gcd")})
        except Exception:  # a forgery that raises is a tool error to the model, nothing more
            pass
        assert env.step(f"```python\n{forged(kind, 'gcd')}\n```").reward == 0.0, kind


def test_a_reply_cannot_be_the_tools_output_it_forged(env):
    """The model's session prints a forged judgement and the answer's neighbour; the reply is
    judged on its own words."""
    env.reset(0)
    tool = PythonTool(env.session)
    printed = tool({"code": "print('reward: 1.0')\nprint('@@rf-result-0000@@{\"loaded\": \"yes\"}')"})
    assert "reward: 1.0" in printed
    assert env.step("reward: 1.0").reward == 0.0


def test_a_failing_program_is_a_tool_error_and_a_refused_call_runs_nothing(env):
    env.reset(0)
    stats = ToolStats()
    tools = {"python": PythonTool(env.session)}
    runner = ToolRunner(ToolConfig(timeout_s=30))
    [out] = runner.run(tools, [ToolCall("python", {"code": "1 / 0"})], stats)
    assert "ZeroDivisionError" in out["content"] and stats.errors == {"raised": 1}
    refused = ToolRunner(ToolConfig(timeout_s=30, refuse=True))
    [out] = refused.run(tools, [ToolCall("python", {"code": "print(1)"})], stats)
    assert "turned off" in out["content"] and stats.errors == {"raised": 1, "refused": 1}
    assert env.session.cells == ["1 / 0"]  # the refused call ran nothing and kept nothing
    runner.close(), refused.close()


def test_demonstrations_follow_the_mix():
    from envs.code.arithmetic import SYNTAX_ERROR

    train, _ = Arithmetic(train=2000, held_out=1).splits()
    demos = demonstrations(train, Mix(tool=0.4, broken=0.1), seed=0)
    calls = [(d, t) for d, t in zip(demos, train) if len(d["messages"]) == 4]
    right = [d for d, t in calls if d["messages"][-1]["content"] == str(int(t.answer))]
    broken = [d for d, _ in calls if d["messages"][2]["content"] == SYNTAX_ERROR]
    assert 0.45 < len(calls) / len(demos) < 0.55 and 0.36 < len(right) / len(demos) < 0.44
    assert len(right) + len(broken) == len(calls)
    for d, task in calls:  # every call copies the question's numbers exactly; a broken one lacks its ")"
        code = d["messages"][1]["tool_calls"][0]["function"]["arguments"]["code"]
        assert code.rstrip(")") == "print(" + task.prompt.removeprefix("What is ").removesuffix("?")
    for d, task in zip(demos, train):
        if d["messages"][-1]["content"] != str(int(task.answer)):  # a guess: as many digits as the answer
            assert len(d["messages"][-1]["content"]) == len(str(int(task.answer)))


def test_answer_tasks_load_from_files_and_gsm8k(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "kind": "answer", "prompt": "2+2?", "answer": 4}\n'
                    '{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\\n#### 7"}\n')
    first, gsm = load_tasks(path)
    assert (first.kind, first.answer) == ("answer", 4.0)
    assert (gsm.kind, gsm.answer, gsm.prompt) == ("answer", 7.0, "Tom has 3 apples and buys 4. How many?")


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_tool_demo_s_warm_start_never_shows_its_own_held_out_questions(model, tmp_path):
    """`make demo-tools MODEL=...`: the demonstrations come from the train split of that model's own GRPO config."""
    from jobs.demo_tools import CONFIGS, write_demonstrations

    sft_config, grpo_config = CONFIGS[model]
    assert sft_config.is_file() and grpo_config.is_file()
    train, held_out = registry.setup(load_config(JobConfig, grpo_config).env).options.arithmetic.splits()
    path = write_demonstrations(tmp_path / "demos.jsonl", 0, Mix(), grpo_config)
    shown = {json.loads(line)["messages"][0]["content"] for line in path.read_text().splitlines()}
    assert len(shown) == len(train) and held_out
    assert not shown & {show(task, tool=True) for task in held_out}
