"""CPU work per step: the `make demo` pipeline against the single-process reference.

Time per step says how fast each goes; CPU-seconds per step say how much work each does, all
processes of the machine counted (the engines, the trainer, the env actors, the driver, Ray's own
GCS and raylet). On a machine with ``cores`` cores no schedule, however well overlapped, finishes
a step in less than its CPU work divided by ``cores``: that floor, set against the reference's
time per step, says whether a target such as "0.8x the reference" is within reach of this
machine at all.

Each is run twice, for ``--short`` and ``--steps`` steps, and per step is the difference over the
difference in steps: start-up, the final evaluation and shutdown cancel out. The machine's busy
CPU time is read from ``/proc/stat`` around each run, less what the machine spent idle-busy in
the seconds before (run it on an otherwise quiet machine).

    python -m bench.cpu_work [--steps 40] [--short 10] [--with-checks] [overrides ...]

``--with-checks`` also runs the pipeline as `make demo` does, with its evaluation, checkpoint and
sync check every 10 steps, and reports what they add against the pipeline without them.

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "jobs/configs/blackjack_tiny.yaml"
TICKS = os.sysconf("SC_CLK_TCK")
BACKGROUND_S = 5.0


def busy_s() -> tuple[float, float]:
    """(seconds of CPU time spent busy, all cores, since boot; wall time now)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks) - idle) / TICKS, time.monotonic()


def background() -> float:
    """Busy CPU-seconds per second while nothing of ours runs."""
    cpu0, wall0 = busy_s()
    time.sleep(BACKGROUND_S)
    cpu1, wall1 = busy_s()
    return (cpu1 - cpu0) / (wall1 - wall0)


def measure(command: list[str], background_rate: float) -> tuple[float, float]:
    """(CPU-seconds, wall seconds) the machine spent while ``command`` ran, background taken off."""
    cpu0, wall0 = busy_s()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    cpu1, wall1 = busy_s()
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    wall = wall1 - wall0
    return cpu1 - cpu0 - background_rate * wall, wall


def pipeline(steps: int, overrides: list[str], out: str) -> list[str]:
    # Without the checkpoints and sync checks along the way, which the reference does not do (the
    # last step's checkpoint cancels out).
    return as_made(steps, ["run.eval_every=0", "run.checkpoint_every=0", "run.sync_check_every=0", *overrides], out)


def as_made(steps: int, overrides: list[str], out: str) -> list[str]:
    """The pipeline as `make demo` runs it: its evaluation, checkpoint and sync check every 10 steps."""
    return [sys.executable, "jobs/grpo.py", "--config", str(CONFIG), f"run.steps={steps}", f"run.output_dir={out}",
            "run.progress=false", *overrides]


def reference(steps: int, overrides: list[str], out: str) -> list[str]:
    return [sys.executable, "-m", "bench.reference", "--steps", str(steps), "--eval-every", str(steps), *overrides]


def per_step(name: str, command, short: int, steps: int, overrides: list[str], rate: float) -> dict[str, float]:
    """CPU-seconds and wall seconds per step of ``command``, by the difference of two run lengths."""
    runs = {}
    for n in (short, steps):
        print(f"{name}: {n} steps ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="cpu_work_") as out:
            runs[n] = measure(command(n, overrides, out), rate)
        print(f"{name}: {n} steps took {runs[n][1]:.1f} s, {runs[n][0]:.1f} CPU-s", file=sys.stderr, flush=True)
    cpu = (runs[steps][0] - runs[short][0]) / (steps - short)
    wall = (runs[steps][1] - runs[short][1]) / (steps - short)
    return dict(cpu_s_per_step=round(cpu, 3), wall_s_per_step=round(wall, 3), cores_busy=round(cpu / wall, 2))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.8, help="the time ratio to the reference asked for")
    parser.add_argument("--with-checks", action="store_true",
                        help="also run the pipeline with the demo's evaluations, checkpoints and sync checks")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for both, as jobs/grpo.py takes them")
    args = parser.parse_args(argv)
    if not 0 < args.short < args.steps:
        parser.error("--short must be between 0 and --steps")
    cores = os.cpu_count()  # /proc/stat counts every core's busy time
    rate = background()
    ref = per_step("reference", reference, args.short, args.steps, args.overrides, rate)
    demo = per_step("pipeline", pipeline, args.short, args.steps, args.overrides, rate)
    floor = demo["cpu_s_per_step"] / cores
    result = dict(bench="cpu_work", cores=cores, background_cores_busy=round(rate, 3), steps=args.steps,
                  short=args.short, reference=ref, pipeline=demo,
                  work_ratio=round(demo["cpu_s_per_step"] / ref["cpu_s_per_step"], 2),
                  time_ratio=round(demo["wall_s_per_step"] / ref["wall_s_per_step"], 2),
                  pipeline_floor_s_per_step=round(floor, 3),
                  floor_ratio=round(floor / ref["wall_s_per_step"], 2), target_ratio=args.target,
                  target_within_work=floor / ref["wall_s_per_step"] <= args.target)
    if args.with_checks:
        checked = per_step("pipeline with checks", as_made, args.short, args.steps, args.overrides, rate)
        result.update(pipeline_with_checks=checked,
                      checks_work_ratio=round(checked["cpu_s_per_step"] / demo["cpu_s_per_step"], 2),
                      checks_time_ratio=round(checked["wall_s_per_step"] / demo["wall_s_per_step"], 2))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
