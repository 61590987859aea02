"""Checkpoint cost: seconds per checkpoint and its share of step time at the default interval.

Runs the `make demo` job (jobs/configs/blackjack_tiny.yaml: 4096 games a step, 2 vLLM engines,
1 TorchTitan rank) for ``--steps`` steps with checkpoints at the default interval
(``run.checkpoint_every``) and no evaluation before the end, then reads its metrics rows. Both
figures come from the same run, so the share is a ratio that machine load affects little:

    share = mean seconds per checkpoint / (checkpoint_every x mean seconds of a step without one)

Also reports the size of one checkpoint (trainer shards, optimizer, buffer) on disk.

    python bench/checkpoint.py [--steps 30] [job overrides ...]

The last line printed is a JSON object.
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

from ray_forge.config import load_config
from ray_forge.config.schema import JobConfig
from ray_forge.core import checkpoint

CONFIG = ROOT / "jobs/configs/blackjack_tiny.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    every = load_config(JobConfig, CONFIG, args.overrides).run.checkpoint_every
    with tempfile.TemporaryDirectory() as out:
        job = [sys.executable, str(ROOT / "jobs/grpo.py"), "--config", str(CONFIG), f"run.steps={args.steps}",
               "run.eval_every=0", "env.options.blackjack.mc_games=1000", "run.progress=false", f"run.output_dir={out}",
               *args.overrides]
        print("running:", " ".join(job[1:]), flush=True)
        subprocess.run(job, check=True, stdout=subprocess.DEVNULL)
        [run_dir] = list(Path(out).iterdir())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        newest = checkpoint.latest(run_dir)
        size_mb = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) / 2**20
    # Step 1 includes the engines' first compiles; the last step also checkpoints at the run's end.
    saving = [r["checkpoint_s"] for r in rows if "checkpoint_s" in r]
    plain = [r["step_time_s"] for r in rows[1:] if "checkpoint_s" not in r]
    per_checkpoint, per_step = statistics.mean(saving), statistics.mean(plain)
    share = per_checkpoint / (every * per_step)
    print(f"{len(saving)} checkpoints of {size_mb:.1f} MB: {per_checkpoint:.3f} s each; a step without one "
          f"{per_step:.3f} s; every {every} steps that is {100 * share:.2f}% of step time")
    print(json.dumps(dict(steps=args.steps, checkpoint_every=every, checkpoints=len(saving),
                          checkpoint_s=round(per_checkpoint, 4), checkpoint_s_max=round(max(saving), 4),
                          step_s=round(per_step, 4), share_of_step_time=round(share, 5),
                          checkpoint_mb=round(size_mb, 2), target_share=0.05, meets_target=share <= 0.05)))


if __name__ == "__main__":
    main()
