"""The GRPO job on the coding and math tasks, short: a tiny BPE Qwen3 in vLLM writes free-form
completions, the env pool runs them in the local sandbox, TorchTitan trains, weights are pushed."""

import asyncio
import json
from pathlib import Path

import pytest

from pictures import assert_drawn
import tiny_configs

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["run.steps=3", "run.eval_every=2", "run.keep_best=true", "run.progress=false",
         "grpo.prompts_per_step=2", "grpo.samples_per_prompt=8", "policy.max_tokens=48", "policy.kv_cache_mb=32",
         "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128", "model.tiny.num_layers=2",
         "cluster.include_dashboard=false"]
REFERENCE_SOLUTION = (
    "def digit_sum(n: int) -> int:\n"
    "    total = 0\n"
    "    while n:\n"
    "        total, n = total + n % 10, n // 10\n"
    "    return total\n"
)


@pytest.fixture(scope="module")
def finished_run(ray_cluster, tmp_path_factory):
    from jobs import grpo

    out = tmp_path_factory.mktemp("runs")
    summary = grpo.main(["--config", str(ROOT / "jobs/configs/code_tiny.yaml"), f"run.output_dir={out}", *SHORT])
    return summary, Path(summary["run_dir"])


def test_job_writes_metrics_evaluations_and_a_final_policy(finished_run):
    summary, run_dir = finished_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert 0.0 <= row["train_reward"] <= 1.0
        assert row["num_games"] == 16  # every completion came back scored by the env pool
        assert 0 <= row["env_errors"] <= 16
        for key in ("weight_sync_s", "weight_publish_s", "weight_load_s", "tokens_per_s", "step_time_s"):
            assert row[key] > 0, key
    assert "eval_return" not in rows[0]
    for row in rows[1:]:  # eval_every=2, and the last step
        for key in ("eval_return", "eval_solved", "eval_code_return", "eval_math_return"):
            assert 0.0 <= row[key] <= 1.0, key
    # Both weight pushes after each step reached the engine: it ended on the last version.
    assert summary["policy_versions"] == [3] and summary["weight_transport"] == "shm"
    assert summary["best_step"] in (2, 3) and summary["best_eval_return"] == max(r["eval_return"] for r in rows[1:])
    for folder in ("final_policy", "best_policy"):
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            assert (run_dir / folder / name).is_file(), (folder, name)
    assert summary["pictures"] == [str(run_dir / "learning_curve.png")]
    # The train reward of every step, and the evaluations of steps 2 and 3, drawn as lines.
    assert_drawn(run_dir / "learning_curve.png", lines=("tab:blue", "tab:green"))


def test_final_evaluation_scored_every_task_in_the_sandbox(finished_run):
    """The greedy evaluation covers all 24 bundled tasks; running its completions again in a
    fresh sandbox gives the same reward and error for every one (so they really ran)."""
    from envs.code.env import CodeEnv
    from envs.code.sandbox import Limits, LocalSandbox
    from envs.code.tasks import load_tasks

    summary, _ = finished_run
    tasks = load_tasks()
    results = summary["tasks"]
    assert [r["id"] for r in results] == [t.id for t in tasks] and len(results) == 24
    assert sum(r["kind"] == "code" for r in results) == sum(r["kind"] == "math" for r in results) == 12
    with LocalSandbox(size=1, limits=Limits(wall_s=3.0, cpu_s=2.0, memory_mb=256, output_bytes=16 * 1024)) as sandbox:
        env = CodeEnv(tasks, sandbox)
        for seed, result in enumerate(results):
            env.reset(seed)
            step = env.step(result["completion"])
            assert 0.0 <= result["reward"] <= 1.0
            assert (step.reward, step.info.get("error")) == (result["reward"], result["error"]), result["id"]
    for kind in ("code", "math"):
        chosen = [r["reward"] for r in results if r["kind"] == kind]
        assert summary[f"{kind}_return"] == pytest.approx(sum(chosen) / 12)
        assert summary[f"{kind}_solved"] == sum(r == 1.0 for r in chosen) / 12
    assert summary["return"] == pytest.approx(sum(r["reward"] for r in results) / 24)
    assert sum(summary["errors"].values()) == sum(r["error"] is not None for r in results)


def test_bpe_tokenizer_round_trips_code_and_the_policys_own_text(finished_run):
    from transformers import AutoTokenizer

    summary, run_dir = finished_run
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final_policy")
    assert tokenizer.decode(tokenizer.encode(REFERENCE_SOLUTION, add_special_tokens=False)) == REFERENCE_SOLUTION
    for completion in (r["completion"] for r in summary["tasks"]):
        assert tokenizer.decode(tokenizer.encode(completion, add_special_tokens=False)) == completion


def test_trainer_steps_on_free_form_completions(finished_run, ray_cluster):
    """A random model passes no task, so in the job every group ties and is dropped before the
    trainer. Here TorchTitan (full vocabulary, no action restriction) trains on the job's own
    multi-token completions with opposite advantages: the loss is finite and the weights move."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from envs.code.env import show
    from envs.code.tasks import load_tasks
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.core.episode import Sample

    summary, run_dir = finished_run
    model_dir = run_dir / "final_policy"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tasks = load_tasks()
    samples = []
    for seed, result in enumerate(summary["tasks"][:8]):
        prompt_ids = tuple(tokenizer.encode(show(tasks[seed]), add_special_tokens=False))
        response_ids = tuple(tokenizer.encode(result["completion"], add_special_tokens=False))[:32] or (2,)
        samples.append(Sample.completion(prompt_ids, response_ids,
                              behaviour_logprobs=(-6.7,) * len(response_ids), advantage=1.0 if seed % 2 else -1.0,
                              policy_version=3))
    rank = TrainerActor.options(num_cpus=0.5).remote(
        tiny_configs.trainer(lr=1e-3, micro_batch_size=4), model_dir=str(model_dir), grpo=tiny_configs.grpo(), total_steps=2,
            rank=0, allowed_token_ids=None)
    group = TrainerGroup([rank], timeout_s=300)
    try:
        group.setup()
        stats = [asyncio.run(group.train_step(samples)) for _ in range(2)]
        asyncio.run(group.export_hf(str(run_dir / "trained_on_code")))
    finally:
        group.shutdown()
        ray_cluster.kill(rank)
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in stats)
    assert stats[0]["entropy"] > 1.0  # a near-uniform random model over ~800 tokens
    before = load_file(str(model_dir / "model.safetensors"))
    after = load_file(str(run_dir / "trained_on_code" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
