"""Resume in the default asynchronous mode: is a killed-and-resumed run within the run-to-run spread?

Runs the `make demo` config (asynchronous: ``buffer.max_policy_lag`` 1) ``--runs`` times without
interruption, then once more killed with SIGKILL right after its checkpoint of step ``--kill-at``
and resumed with ``--resume``. All runs have the same seed: in asynchronous mode the timing of
rollouts against training still changes which samples a step sees, so they differ, and that
difference is the spread. Reports each run's exact return at every evaluation and whether the
resumed run's values lie within the uninterrupted runs' range, and within two of their standard
deviations of their mean, at each one.

    python bench/resume_spread.py [--runs 3] [--steps 40] [--kill-at 20] [job overrides ...]

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "jobs/configs/blackjack_tiny.yaml"


def job(out: Path, steps: int, overrides: list[str], *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "jobs/grpo.py"), "--config", str(CONFIG), f"run.steps={steps}",
            "run.eval_every=10", "run.checkpoint_every=10", "env.options.blackjack.mc_games=1000", "run.progress=false",
            f"run.output_dir={out}", *overrides, *extra]


def evals(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_return"] for r in rows if r.get("eval_return") is not None}


def killed_and_resumed(out: Path, steps: int, kill_at: int, overrides: list[str]) -> tuple[Path, float]:
    proc = subprocess.Popen(job(out, steps, overrides), start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    marker = f"*/checkpoints/step-{kill_at:08d}/manifest.json"
    while not list(out.glob(marker)):
        if proc.poll() is not None:
            raise RuntimeError("the run ended before it could be killed")
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    [run_dir] = list(out.iterdir())
    start = time.monotonic()
    subprocess.run([sys.executable, str(ROOT / "jobs/grpo.py"), "--resume", str(run_dir)], check=True,
                   stdout=subprocess.DEVNULL)
    return run_dir, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.kill_at % 10 or not 0 < args.kill_at < args.steps:
        parser.error("--kill-at must be a checkpointed step (a multiple of 10) before --steps")
    with tempfile.TemporaryDirectory() as tmp:
        plain = []
        for i in range(args.runs):
            out = Path(tmp) / f"plain{i}"
            subprocess.run(job(out, args.steps, args.overrides), check=True, stdout=subprocess.DEVNULL)
            plain.append(evals(next(out.iterdir())))
            print(f"uninterrupted run {i}: {plain[-1]}", flush=True)
        resumed_dir, _ = killed_and_resumed(Path(tmp) / "resumed", args.steps, args.kill_at, args.overrides)
        resumed = evals(resumed_dir)
        print(f"killed at step {args.kill_at} and resumed: {resumed}", flush=True)
    steps = sorted(resumed)
    low = {s: min(p[s] for p in plain) for s in steps}
    high = {s: max(p[s] for p in plain) for s in steps}
    inside = {s: low[s] <= resumed[s] <= high[s] for s in steps}
    mean = {s: statistics.mean(p[s] for p in plain) for s in steps}
    sd = {s: statistics.stdev(p[s] for p in plain) for s in steps}
    # With a handful of runs a range is narrow: also judge by two standard deviations of the runs.
    within_2sd = {s: abs(resumed[s] - mean[s]) <= 2 * sd[s] for s in steps}
    after_kill = [s for s in steps if s > args.kill_at]
    print(json.dumps(dict(runs=args.runs, steps=args.steps, killed_after_checkpoint=args.kill_at,
                          eval_steps=steps, uninterrupted=[[p[s] for s in steps] for p in plain],
                          resumed=[resumed[s] for s in steps], spread_low=[low[s] for s in steps],
                          spread_high=[high[s] for s in steps], inside=[inside[s] for s in steps],
                          mean=[round(mean[s], 5) for s in steps], sd=[round(sd[s], 5) for s in steps],
                          within_2sd=[within_2sd[s] for s in steps],
                          within_2sd_after_kill=all(within_2sd[s] for s in after_kill))))


if __name__ == "__main__":
    main()
