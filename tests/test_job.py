"""The real BlackJack job, short: vLLM + TorchTitan + reference + weight push, end to end, then the eval job."""

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["run.steps=3", "run.eval_every=3", "env.options.blackjack.mc_games=500", "grpo.prompts_per_step=8",
         "grpo.samples_per_prompt=8", "grpo.kl_coef=0.05", "trainer.lr=1e-3", "run.progress=false",
         "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128", "model.tiny.num_layers=2",
         "cluster.include_dashboard=false", "policy.kv_cache_mb=64",
         # Qwen3 up to 4B ties its embeddings: the job runs tied, and compares the engine with the
         # trainer after every sync.
         "model.tiny.tie_word_embeddings=true", "run.sync_check_every=1",
         # The asynchronous loop (the demo is synchronous now): training overlaps the next batch.
         "buffer.max_policy_lag=1"]


class MetricsScraper(threading.Thread):
    """Polls the node's Prometheus endpoint while the job runs, keeping the latest value of every
    ``ray_forge_*`` series per run tag, as a Prometheus server scraping the node would."""

    LINE = re.compile(r'^ray_forge_(\w+)\{[^}]*\brun="([^"]+)"[^}]*\} (\S+)$', re.MULTILINE)

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.seen, self.scrapes = url, {}, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            try:
                text = urllib.request.urlopen(self.url, timeout=10).read().decode()
            except OSError:
                continue
            self.scrapes += 1
            for name, run, value in self.LINE.findall(text):
                self.seen.setdefault(run, {})[name] = float(value)


def last_logged(run_dir: Path) -> dict[str, float]:
    """The last value the run logged for each exported metric."""
    from ray_forge.observe.metrics import EXPORTED

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {key: float(next(r[key] for r in reversed(rows) if r.get(key) is not None)) for key in EXPORTED}


@pytest.fixture(scope="module")
def finished_run(ray_cluster, tmp_path_factory):
    from jobs import grpo

    node = next(n for n in ray_cluster.nodes() if n["Alive"])
    scraper = MetricsScraper(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics")
    scraper.start()
    out = tmp_path_factory.mktemp("runs")
    try:
        summary = grpo.main(["--config", str(ROOT / "jobs/configs/blackjack_tiny.yaml"),
                             f"run.output_dir={out}", *SHORT, "run.loggers=[jsonl, tensorboard, wandb]"])
        # The exporter publishes every few seconds: give the last step's values time to arrive.
        want = last_logged(Path(summary["run_dir"]))
        deadline = time.monotonic() + 30
        while scraper.seen.get(Path(summary["run_dir"]).name) != want and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        scraper.done.set()
        scraper.join(timeout=30)
    summary["_scraped"] = scraper.seen.get(Path(summary["run_dir"]).name, {})
    return summary, Path(summary["run_dir"])


def test_job_writes_metrics_and_a_final_policy(finished_run):
    summary, run_dir = finished_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("wall_time_s", "train_reward", "loss", "kl", "policy_lag", "tokens_per_s", "step_time_s",
                "weight_sync_s", "weight_publish_s", "grad_norm", "clip_fraction", "entropy"):
        assert all(key in r for r in rows), key
    assert "eval_return" in rows[-1] and -1.0 <= rows[-1]["eval_return"] <= 1.0
    assert any(r["kl"] > 0 for r in rows[1:])  # the reference actor ran and the policy moved away from it
    assert rows[-1]["version"] == 3
    # buffer.fixed_lag (the demo's) with a lag of 1: batch b is played wholly by version b - 1, whatever the machine's
    # pace, and trained at step b + 1, from version b: no weights landed in the middle of a batch.
    assert [(r["policy_lag"], r["policy_lag_max"]) for r in rows] == [(0.0, 0), (1.0, 1), (1.0, 1)]
    # Every weight push went through the store, and both engines ended on the last version: the
    # demo config's moving average of the weights (trainer.ema_decay), published after step 3.
    assert summary["weight_transport"] == summary["weight_route"] == "shm" and summary["policy_versions"] == [4, 4]
    assert summary["final_weights"] == "moving average (trainer.ema_decay 0.9)"
    assert summary["sync_greedy_agreement"] == 1.0  # and policy-0 was checked against it
    # The trainer's publish and each engine's fetch and load lie inside the driver's sync. They may
    # overlap: the trainer frees the versions beyond weights.keep_versions after publishing, while
    # the engines already fetch and load the new one.
    assert all(0 < r["weight_publish_s"] <= r["weight_sync_s"] for r in rows)
    assert all(0 < r["weight_fetch_s"] + r["weight_load_s"] <= r["weight_sync_s"] for r in rows)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (run_dir / "final_policy" / name).is_file(), name
    assert set(summary) >= {"exact_return", "mc_return", "agreement"}
    assert (run_dir / "config.yaml").read_text().count("kl_coef: 0.05") == 1


def test_every_scalar_of_metrics_jsonl_reaches_tensorboard_and_wandb_at_its_step(finished_run):
    """run.loggers: the job's own rows, read back with TensorBoard's reader and from the offline
    wandb run's records, and its pictures as images."""
    from tracker_files import assert_trackers_hold_every_scalar

    _, run_dir = finished_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    numbers = [(k, r["step"]) for r in rows for k, v in r.items()
               if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert len(numbers) > 100 and {step for _, step in numbers} == {1, 2, 3}
    assert_trackers_hold_every_scalar(run_dir, images={"learning_curve", "decision_table"})


def test_after_every_sync_the_engine_computes_what_the_trainer_computes(finished_run):
    """Tied embeddings: after each of the 3 syncs, vLLM's greedy action equals the trainer's
    argmax in all 360 states, and its logprobs equal the trainer's within 1e-4 (fp32)."""
    summary, run_dir = finished_run
    assert json.loads((run_dir / "initial_model" / "config.json").read_text())["tie_word_embeddings"] is True
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["sync_greedy_agreement"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(0 <= r["sync_logprob_max_diff"] <= 1e-4 for r in rows), [r["sync_logprob_max_diff"] for r in rows]


def test_the_job_over_nixl_keeps_both_engines_equal_to_the_trainer(ray_cluster, tmp_path):
    """The same short job with weights.transport=nixl (tied, 1 rank): both engines end on the last
    version, equal to the trainer in all 360 states after every sync, and the summary says which
    UCX transport carried the bytes into policy-0."""
    from jobs import grpo

    summary = grpo.main(["--config", str(ROOT / "jobs/configs/blackjack_tiny.yaml"), f"run.output_dir={tmp_path}",
                         *SHORT, "weights.transport=nixl", "grpo.kl_coef=0"])
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert summary["weight_transport"] == "nixl" and summary["policy_versions"] == [4, 4]  # 3 steps, the average
    assert re.fullmatch(r"nixl \(UCX: \S+/\S+ \((intra|inter)-node\)\)", summary["weight_route"]), summary
    assert [r["sync_greedy_agreement"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(0 <= r["sync_logprob_max_diff"] <= 1e-4 for r in rows), [r["sync_logprob_max_diff"] for r in rows]
    assert all(r["weight_fetch_s"] > 0 and r["gen_paused_s"] >= r["weight_load_s"] > 0 for r in rows)


def test_policy_weights_changed_and_vllm_matches_the_trainer(finished_run):
    """final_policy holds the trainer's weights; the final evaluation asked vLLM (after the last
    sync) for its greedy action in all 360 states. Both must agree everywhere."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs.blackjack import render_state
    from envs.blackjack.exact import all_states
    from envs.blackjack.policy_eval import state_key

    summary, run_dir = finished_run
    final = load_file(str(run_dir / "final_policy" / "model.safetensors"))
    initial = load_file(str(run_dir / "initial_model" / "model.safetensors"))
    assert set(final) == set(initial)
    assert any(not torch.equal(final[k], initial[k]) for k in final)

    decisions = json.loads((run_dir / "eval.json").read_text())["decisions"]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_policy")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final_policy")
    hit, stick = tokenizer.convert_tokens_to_ids(["HIT", "STICK"])
    states = all_states()
    ids = torch.tensor([tokenizer.encode(render_state(s), add_special_tokens=False) for s in states])
    with torch.no_grad():
        last = model(ids).logits[:, -1]
    trainer_hits = (last[:, hit] > last[:, stick]).tolist()
    assert [decisions[state_key(s)] for s in states] == [int(h) for h in trainer_hits]


def test_eval_job_prints_json_last_line(finished_run):
    summary, run_dir = finished_run
    proc = subprocess.run([sys.executable, str(ROOT / "jobs/eval_blackjack.py"), "--policy",
                           str(run_dir / "final_policy"), "--mc-games", "2000"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) >= {"exact_return", "mc_return", "agreement"}
    assert result["exact_return"] == pytest.approx(summary["exact_return"], abs=1e-9)
    assert abs(result["mc_return"] - result["exact_return"]) < 5 * result["mc_stderr"] + 1e-3


def test_missing_model_path_fails_fast_with_the_path(tmp_path):
    from jobs import grpo
    from ray_forge.models.tiny import ModelError

    with pytest.raises(ModelError, match="does not exist"):
        grpo.main([f"run.output_dir={tmp_path / 'runs'}", f"model.path={tmp_path / 'missing'}"])
    assert not (tmp_path / "runs").exists()  # no empty run directory left behind


def test_bad_override_fails_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "jobs/grpo.py"), "trainer.lrr=1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "unknown config key 'trainer.lrr'" in proc.stderr


def test_job_draws_its_learning_curve_and_decision_table(finished_run):
    from pictures import CELLS, HIT, STICK, assert_drawn, png_size

    summary, run_dir = finished_run
    pictures = {Path(p).name: Path(p) for p in summary["pictures"]}
    assert set(pictures) == {"learning_curve.png", "decision_table.png"}
    assert png_size(pictures["learning_curve.png"]) == (1200, 800)
    assert png_size(pictures["decision_table.png"]) == (1200, 1000)
    assert all(path.parent == run_dir for path in pictures.values())
    assert_drawn(pictures["learning_curve.png"], lines=("tab:blue",))  # the train reward, step by step
    assert_drawn(pictures["decision_table.png"], areas={STICK: CELLS, HIT: CELLS})  # the optimal half has both


def test_step_metrics_reach_rays_metrics_endpoint(finished_run):
    """During the run, the driver's gauges could be read from the node's metrics endpoint (what
    Prometheus scrapes for Grafana and the dashboard), each holding the step's logged value."""
    from ray_forge.actors.buffer import COUNTERS

    summary, run_dir = finished_run
    assert summary["_scraped"] == pytest.approx(last_logged(run_dir), rel=1e-5, abs=1e-6)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["episodes_per_s"] > 0
    for row in rows:  # every game played was trained on, evicted, dropped or is still buffered
        assert row["generated"] == sum(row[k] for k in COUNTERS[1:]) + row["buffer_size"], row
    # Each of the 3 steps took 64 games that no step takes again (buffer.max_uses 1): trained, or dropped as ties.
    assert rows[-1]["trained"] + rows[-1]["dropped_no_signal"] == 3 * 64
