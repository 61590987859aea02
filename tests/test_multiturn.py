"""Multi-turn tool episodes with the real parts: vLLM samples token in, token out; TorchTitan scores
the whole sequence; the GRPO job trains on the code env with the python tool in the loop, in the
local sandbox and in Together's Code Interpreter (a loopback server speaking its JSON)."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.tool_model import FOLDER_TEMPLATE, SECRET, CheckedAnswer, make_tool_caller
from pictures import assert_drawn
import tiny_configs

ROOT = Path(__file__).resolve().parent.parent
JOB = ["run.steps=3", "run.eval_every=3", "run.progress=false", "grpo.prompts_per_step=2", "grpo.samples_per_prompt=8",
       "policy.max_tokens=48", "policy.kv_cache_mb=64", "trainer.lr=1e-5", "cluster.include_dashboard=false"]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    from envs.code.spec import CodeOptions, corpus

    return str(make_tool_caller(tmp_path_factory.mktemp("models") / "tool_caller", corpus(CodeOptions(tool=True))))


@pytest.mark.vllm
@pytest.mark.ray
def test_after_a_sync_the_engine_s_logprobs_of_a_tool_episode_equal_the_trainer_s(tool_model, ray_cluster):
    """Every sampled token of 4-turn tool episodes: vLLM's behaviour logprob equals TorchTitan's on
    the whole sequence within 1e-4 (fp32), after a training step was pushed to the engine."""
    import ray
    from transformers import AutoTokenizer

    from ray_forge.actors.policy import VLLMPolicy
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.config.schema import ToolConfig
    from ray_forge.core.chat import ChatFormat
    from ray_forge.core.episode import Sample
    from ray_forge.core.play import EpisodeRules, Play
    from ray_forge.weights import StoreSpec, WeightStore

    policy = VLLMPolicy(tiny_configs.policy(constrain_to_actions=False, max_tokens=48, max_model_len=1024, kv_cache_mb=64),
                        model_dir=tool_model, action_words=None)
    rank = TrainerActor.options(num_cpus=0.5).remote(tiny_configs.trainer(lr=1e-4), model_dir=tool_model, grpo=tiny_configs.grpo(),
                                                     total_steps=5, rank=0, allowed_token_ids=None)
    trainer = TrainerGroup([rank], timeout_s=300)
    store = WeightStore.create(StoreSpec(name="multiturn-sync", transport="shm"))
    envs = [CheckedAnswer() for _ in range(6)]
    chat = ChatFormat(AutoTokenizer.from_pretrained(tool_model), [tool.schema for tool in envs[0].tools()])

    async def engine(prompts, max_tokens, stops, call):
        return await asyncio.to_thread(policy.generate_ids, prompts, max_tokens, stops, False, 1000 + call)

    def play():
        rules = EpisodeRules(mode="sequence", max_turns=4, turn_tokens=48, episode_tokens=1024,
                             tools=ToolConfig(timeout_s=10))
        return asyncio.run(Play([(i, i) for i in range(len(envs))], envs, engine, rules, chat=chat, max_model_len=1024,
                                threads=None, env_timeout_s=60).run())

    try:
        trainer.setup()
        first = play()
        samples = [Sample.of_segment(s, advantage=1.0 if e.reward else -1.0) for e in first for s in e.segments]
        asyncio.run(trainer.train_step(samples))
        asyncio.run(trainer.publish_weights(store.spec, 1))
        policy.update_weights(store.spec, 1)
        episodes = play()
        tool_episodes = [e for e in episodes if len(e.turns) == 4 and e.stats["tool_calls"] >= 2]
        assert tool_episodes, [(len(e.turns), e.stats) for e in episodes]
        for episode in episodes:
            [segment] = episode.segments
            ids = list(segment.token_ids)
            logits = ray.get(rank.logits.remote([ids]), timeout=120)[0]
            logprobs = torch.log_softmax(logits.float(), -1)
            positions = [t for t, m in enumerate(segment.loss_mask) if m]
            trainer_lp = torch.stack([logprobs[t - 1, ids[t]] for t in positions])
            engine_lp = torch.tensor(segment.logprobs)
            assert set(segment.token_versions) == {1}
            assert (trainer_lp - engine_lp).abs().max().item() < 1e-4, (trainer_lp - engine_lp).abs().max()
    finally:
        trainer.shutdown()
        ray.kill(rank)
        store.destroy()
        policy.shutdown()


def _check_the_tool_kept_its_session(summary: dict, rows: list[dict]) -> None:
    """The greedy evaluation's episodes set x in one call and read it in the next."""
    tasks = summary["tasks"]
    assert len(tasks) == 24
    for task in tasks:
        tools = [m["content"] for m in task["messages"] if m["role"] == "tool"]
        assert tools[:2] == ["[no output]", SECRET], task["messages"]
        assert task["tool_calls"] == 2
    for row in rows:
        assert row["tool_calls_per_episode"] > 0 and row["segments_per_episode"] == 1.0
        assert row["tokens_per_episode"] > 100 and row["num_games"] == 16
    # The final evaluation's return is its tasks' mean reward, and step 3's evaluation of the same
    # weights, playing the same script greedily, got the same.
    assert summary["eval_return"] == pytest.approx(sum(task["reward"] for task in tasks) / len(tasks))
    assert rows[-1]["eval_return"] == pytest.approx(summary["eval_return"], abs=1e-6)  # the row keeps 6 digits


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_a_three_step_job_of_the_multi_turn_code_env_in_the_local_sandbox(tool_model, ray_cluster, tmp_path):
    from jobs import grpo

    from ray_forge.actors.launch import chat_tokenizer
    from ray_forge.core.chat import TINY_TEMPLATE

    # The folder's own template (Qwen3's format, written by the test), not the tiny model's, renders the episodes.
    assert chat_tokenizer(tool_model).chat_template == FOLDER_TEMPLATE != TINY_TEMPLATE
    summary = grpo.main(["--config", str(ROOT / "jobs/configs/code_tools_tiny.yaml"), f"run.output_dir={tmp_path}",
                         f"model.path={tool_model}", *JOB])
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_the_tool_kept_its_session(summary, rows)


# -- the tool workload's own job (jobs/configs/arith_tools_tiny.yaml) through the other backends --

ARITH = ["--config", "jobs/configs/arith_tools_tiny.yaml", "run.steps=3", "run.eval_every=3", "run.progress=false",
         "grpo.prompts_per_step=2", "grpo.samples_per_prompt=8", "policy.kv_cache_mb=64", "cluster.include_dashboard=false",
         "run.sync_check_every=3", "env.options.code.arithmetic.train=64", "env.options.code.arithmetic.held_out=8",
         "trainer.lr=1e-5"]  # the scripted model stays on its script for the checks


ARITH_TASKS = {"train": 64, "held_out": 8}


@pytest.fixture(scope="module")
def arith_model(tmp_path_factory) -> str:
    """The scripted tool caller, trained on the questions these jobs deal and hold out."""
    from envs.code.arithmetic import Arithmetic
    from envs.code.spec import CodeOptions, corpus

    options = CodeOptions(tool=True, arithmetic=Arithmetic(**ARITH_TASKS))
    tasks = options.task_list() + options.eval_list()
    return str(make_tool_caller(tmp_path_factory.mktemp("models") / "arith_caller", corpus(options), tasks))


def _check_the_arithmetic_run(run_dir: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: the evaluation before training
    for row in rows[1:]:
        assert row["num_games"] == 16 and row["tool_calls_per_episode"] > 0
    for row in (rows[0], rows[-1]):
        assert 0.0 <= row["eval_sampled_solved"] <= 1.0 and row["eval_sampled_tool_calls"] > 0
        assert 0.0 <= row["eval_sampled_called"] <= 1.0  # sampled at T=1 the script's calls may all break
        assert row["eval_tool_calls"] == 2.0 and row["eval_tool_errors"] == 0.0 and row["eval_called"] == 1.0
    summary = json.loads((run_dir / "eval.json").read_text())
    assert len(summary["tasks"]) == 8 and all("sampled" in t for t in summary["tasks"])
    for task in summary["tasks"]:  # the greedy script: x set in one call, read in the next, then "7"
        tools = [m["content"] for m in task["messages"] if m["role"] == "tool"]
        assert tools == ["[no output]", SECRET] and task["tool_calls"] == 2, task["messages"]
        assert task["tool_errors"] == task["malformed_calls"] == 0 and task["error"] is None and task["reward"] == 0.0  # "7": wrong
    assert summary["pictures"] == [str(run_dir / "learning_curve.png"), str(run_dir / "tool_use.png")]
    kept = sorted(p.name for p in (run_dir / "evaluations").iterdir())
    assert kept == ["step-00000.json", "step-00003.json"]  # every evaluation's episodes, the first included
    first = json.loads((run_dir / "evaluations" / "step-00000.json").read_text())
    assert [t["id"] for t in first["tasks"]] == [t["id"] for t in summary["tasks"]] and first["policy_version"] == 0
    # Tool calls and tokens per episode, step by step (the pass rates may lie on the axis at 0).
    assert_drawn(run_dir / "tool_use.png", lines=("tab:blue", "tab:purple"))


@pytest.mark.slow
@pytest.mark.vllm
def test_the_tool_workload_runs_three_steps_through_together_s_interpreter(arith_model, tmp_path):
    """The job in a process of its own (its own local Ray cluster), whose env actors reach the
    loopback server with the key from their environment, as a pod's would from a Secret; the
    session kept between calls is checked by ``_check_the_arithmetic_run`` (x set, then read)."""
    from together_server import TogetherServer

    key = "test-key-arithmetic"
    with TogetherServer(key) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(TOGETHER_API_KEY=key, TOGETHER_BASE_URL=server.url, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "jobs/grpo.py", *ARITH, f"run.output_dir={tmp_path}",
                               f"model.path={arith_model}", "cluster.address=local",
                               "env.options.code.backend=together"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        executed = [r["body"]["code"] for r in server.behaviour.requests if r["body"]]
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    _check_the_arithmetic_run(run_dir)
    assert f"x = {SECRET}" in executed and "print(x)" in executed  # the model's calls ran there
    assert key not in done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_the_tool_workload_runs_three_steps_through_the_code_env_s_openenv_server(arith_model, ray_cluster,
                                                                                 tmp_path):
    """The code env served by ``envs/openenv_server.py``, its python tool called over the game's
    own session: the job plays, evaluates and trains through it as it does locally."""
    from jobs import grpo
    from servers import serving

    options = ["tool=true", "arithmetic.train=64", "arithmetic.held_out=8", "limits.wall_s=3"]
    with serving("-m", "envs.openenv_server", "--env", "code", "--max-sessions", "96", *options) as (url, _):
        summary = grpo.main([*ARITH, f"run.output_dir={tmp_path}", f"model.path={arith_model}",
                             "env.name=openenv", f"env.options.openenv.url={url}", "env.options.openenv.kind=code",
                             "env.options.openenv.concurrency=2"])
    _check_the_arithmetic_run(Path(summary["run_dir"]))


def test_a_served_episode_s_tool_keeps_its_session_and_reports_errors():
    from envs.openenv_adapter import OpenEnvOptions, OpenEnvTextEnv
    from ray_forge.core.tools import ToolError
    from servers import serving

    with serving("-m", "envs.openenv_server", "--env", "code", "tool=true", "arithmetic.train=4",
                 "arithmetic.held_out=2") as (url, _):
        env = OpenEnvTextEnv(OpenEnvOptions(url=url, kind="code"), 0.0)
        try:
            [tool] = env.tools()
            assert tool.name == "python" and tool.schema["function"]["name"] == "python"
            prompt = env.reset(-1)  # a held-out question, as the evaluation deals it
            assert prompt.startswith("What is ")
            assert tool({"code": "x = 6 * 7"}) == "[no output]"
            assert tool({"code": "print(x)"}) == "42"
            with pytest.raises(ToolError, match="ZeroDivisionError"):
                tool({"code": "1 / 0"})
            answer = eval(prompt.split("?")[0].removeprefix("What is "))  # the test's own question
            assert env.step(str(answer)).reward == 1.0
        finally:
            env.close()
