"""Pipeline: the GRPO job's step time against the limit its stages set, and the weight-sync stall.

Runs the ``make demo`` job twice in one sitting, evaluations and sync checks off:
- ``sync``: ``buffer.max_policy_lag=0``, so a batch is generated only once the weights that
  play it are out, and the trainer waits for it: generation and training each run alone, and
  the run measures each (``rollout_batch_s``, ``train_s``);
- ``async``: the default (lag 1): the next batch plays while the trainer steps, and the weights
  are loaded into the engines between two steps while they generate.
Targets: the async step at most 1.15x max(generation alone, training alone); the time an engine
stands still for an update (``gen_paused_s``) at most 1.5x its own pull (``weight_load_s``).
Medians over the steps after the first ``--skip``. Last line: a JSON object.

    python -m bench.pipeline [--steps 25] [--skip 5] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_job(out_dir: str, name: str, steps: int, overrides: list[str]) -> list[dict]:
    """The demo job for ``steps`` steps; its metrics rows."""
    command = [sys.executable, str(ROOT / "jobs" / "grpo.py"), "--config", str(ROOT / "jobs/configs/blackjack_tiny.yaml"),
               f"run.name={name}", f"run.output_dir={out_dir}", f"run.steps={steps}", "run.eval_every=0",
               "run.sync_check_every=0", "run.checkpoint_every=0", "env.options.blackjack.mc_games=0", "run.progress=false",
               "cluster.include_dashboard=false", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    return [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]


def median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out (start-up, first batches)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both runs")
    args = parser.parse_args()
    out_dir = tempfile.mkdtemp(prefix="bench-pipeline-")
    sync = run_job(out_dir, "sync", args.steps, ["buffer.max_policy_lag=0", *args.overrides])[args.skip:]
    pipelined = run_job(out_dir, "async", args.steps, args.overrides)[args.skip:]
    gen_s, train_s = median(sync, "rollout_batch_s"), median(sync, "train_s")
    limit_s = max(gen_s, train_s)
    step_s, sync_step_s = median(pipelined, "step_time_s"), median(sync, "step_time_s")
    paused_s, load_s = median(pipelined, "gen_paused_s"), median(pipelined, "weight_load_s")
    print(json.dumps({
        "steps_measured": len(pipelined), "generation_alone_s": round(gen_s, 3), "training_alone_s": round(train_s, 3),
        "async_step_s": round(step_s, 3), "sync_step_s": round(sync_step_s, 3),
        "async_vs_limit": round(step_s / limit_s, 3), "sync_vs_async": round(sync_step_s / step_s, 3),
        "weight_sync_s": round(median(pipelined, "weight_sync_s"), 4), "weight_load_s": round(load_s, 4),
        "gen_paused_s": round(paused_s, 4), "weight_wait_s": round(median(pipelined, "weight_wait_s"), 4),
        "stall_vs_pull": round(paused_s / load_s, 3),
        "targets": {"async_vs_limit": 1.15, "stall_vs_pull": 1.5},
        "met": {"async_vs_limit": step_s / limit_s <= 1.15, "stall_vs_pull": paused_s / load_s <= 1.5},
    }))


if __name__ == "__main__":
    main()
