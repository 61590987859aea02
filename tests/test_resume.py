"""Checkpoint and exact resume of the real BlackJack job: a driver killed with SIGKILL mid-run is
resumed, and in synchronous mode its weights equal an uninterrupted run's bit for bit."""

import json
import pickle
import signal
from pathlib import Path

import pytest
import torch

from killed_job import run_until
from ray_forge.core import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
# Synchronous (max_policy_lag 0): every batch is played by the newest weights only, so timing cannot
# change which games a step trains on. No evaluation before the end: it would use policy-0 in between.
SYNC = ["--config", str(ROOT / "jobs/configs/blackjack_tiny.yaml"), "run.steps=4", "run.checkpoint_every=2",
        "run.eval_every=0", "env.options.blackjack.mc_games=200", "grpo.prompts_per_step=8", "buffer.max_policy_lag=0",
        "run.progress=false", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128",
        "model.tiny.num_layers=2", "cluster.include_dashboard=false", "policy.kv_cache_mb=64", "run.seed=3",
        "grpo.kl_coef=0.05",  # with a reference model: it must stay the base model across a resume
        "trainer.ema_decay=0.5"]  # and a moving average, which the run ends on: it must be in the checkpoints


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final_policy" / "model.safetensors"))


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory):
    from jobs import grpo

    summary = grpo.main([*SYNC, f"run.output_dir={tmp_path_factory.mktemp('plain')}"])
    return Path(summary["run_dir"])


def test_killed_driver_resumes_to_the_same_weights_bit_for_bit(uninterrupted, tmp_path, caplog):
    from jobs import grpo

    out = tmp_path / "runs"
    proc = run_until([*SYNC, f"run.output_dir={out}"],
                     lambda: any((p / "manifest.json").exists() for p in out.glob("*/checkpoints/step-00000002")))
    assert proc.returncode == -signal.SIGKILL
    [run_dir] = list(out.iterdir())
    assert not (run_dir / "final_policy").exists()  # it really stopped mid-run
    saved = checkpoint.read_driver_state(checkpoint.latest(run_dir))
    assert saved["step"] == 2 and saved["policy_version"] == 2
    with open(checkpoint.latest(run_dir) / checkpoint.BUFFER_STATE, "rb") as f:  # the buffer wrote its own games
        buffered = sum(len(group) for group, _ in pickle.load(f)["entries"])
    assert buffered == saved["buffer"]["games"]

    with caplog.at_level("INFO"):
        summary = grpo.main(["--config", str(ROOT / "jobs/configs/blackjack_tiny.yaml"), "--resume", "auto",
                             f"run.output_dir={out}"])
    assert Path(summary["run_dir"]) == run_dir  # auto found the unfinished run
    assert (f"step 2, policy version 2, {buffered} games buffered, next batch {saved['buffer']['next_batch']}"
            in caplog.text)
    assert summary["policy_versions"] == [5, 5]  # 4 steps, then the average
    assert summary["final_weights"] == "moving average (trainer.ema_decay 0.5)"
    resumed, plain = rows(run_dir), rows(uninterrupted)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # appended, no step twice
    for key in ("train_reward", "loss", "kl", "grad_norm", "generated", "trained", "buffer_size"):
        assert [r[key] for r in resumed] == [r[key] for r in plain], key
    assert_bitwise_equal(final_weights(run_dir), final_weights(uninterrupted))


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(uninterrupted, tmp_path, caplog):
    import shutil

    from jobs import grpo

    run_dir = tmp_path / uninterrupted.name
    shutil.copytree(uninterrupted, run_dir)
    shutil.rmtree(run_dir / "final_policy")
    (run_dir / "eval.json").unlink()
    newest = run_dir / "checkpoints" / "step-00000004"
    shard = newest / "trainer" / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with caplog.at_level("INFO"):
        summary = grpo.main(["--resume", str(run_dir)])
    assert "checkpoint step-00000004 skipped: trainer/__0_0.distcp is" in caplog.text
    assert "from step-00000002: step 2" in caplog.text
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4]
    assert summary["policy_versions"] == [5, 5]  # 4 steps, then the average
    # Steps 3 and 4 done again from step 2 give the same weights as the first time.
    assert_bitwise_equal(final_weights(run_dir), final_weights(uninterrupted))
