"""Print a run's learning curve (its env's evaluation of the greedy policy against step and wall
time) as Markdown; with ``--beside``, also draw several runs' evaluation curves and actor restarts
in one PNG, or their returns against time.

    python jobs/learning_curve.py runs/<run>
    python jobs/learning_curve.py runs/<chaos run> --beside runs/<undisturbed run> --png side_by_side.png \
        --labels "killed every ~60 s" undisturbed
    python jobs/learning_curve.py runs/<after> --beside runs/<before> --time-png timed.png --labels after before \
        --reference reference.json --target -0.060     # return against seconds since the first step
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from envs import registry
from ray_forge.config import ConfigError
from ray_forge.core.env import EnvSetup
from ray_forge.observe.metrics import read_metrics
from ray_forge.run.directory import FINISHED_FILE, load_run_config

PREFIX = "eval_"
NOT_SHOWN = ("eval_policy_version", "eval_s")


def run_env(run_dir: Path) -> EnvSetup:
    """The env a run played, from the config it kept."""
    return registry.setup(load_run_config(run_dir).env)


def curve_table(run_dir: Path) -> str:
    rows = read_metrics(run_dir / "metrics.jsonl")
    names = sorted({k for r in rows for k in r if k.startswith(PREFIX) and k not in NOT_SHOWN},
                   key=lambda k: (k != "eval_return", k))
    lines = ["| step | games | wall time | " + " | ".join(k[len(PREFIX):] for k in names) + " |",
             "|---:|---:|---:|" + "---:|" * len(names)]
    games = 0
    for r in rows:
        games += r.get("num_games", 0)
        if r.get("eval_return") is None:
            continue
        minutes, seconds = divmod(int(r["wall_time_s"]), 60)
        lines.append(f"| {r['step']} | {games:,} | {minutes}:{seconds:02d} | "
                     + " | ".join(f"{r.get(k, float('nan')):.4f}" for k in names) + " |")
    final = run_dir / FINISHED_FILE
    if final.is_file():
        result = json.loads(final.read_text())
        numbers = {k: v for k, v in result.items() if isinstance(v, float) and k not in NOT_SHOWN}
        logged = {k[len(PREFIX):]: v for k, v in numbers.items() if k.startswith(PREFIX)}
        shown = ", ".join(f"{k} **{v:.4f}**" for k, v in (logged or numbers).items())  # older runs logged none
        lines += ["", f"Final policy: {shown}."]
    return "\n".join(lines)


def evals_against_time(rows: list[dict]) -> list[tuple[float, float]]:
    """(seconds since the first step began, evaluation return) of every evaluation of a run."""
    start = rows[0]["wall_time_s"] - rows[0]["step_time_s"]
    return [(r["wall_time_s"] - start, r["eval_return"]) for r in rows if r.get("eval_return") is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--beside", type=Path, nargs="*", default=[], help="other runs to draw beside it")
    parser.add_argument("--png", type=Path, help="where to draw the runs side by side")
    parser.add_argument("--labels", nargs="*", help="one legend label per run (default: the folder names)")
    parser.add_argument("--time-png", type=Path, help="where to draw the runs' returns against time")
    parser.add_argument("--reference", type=Path, help="the JSON line `python -m bench.reference` printed")
    parser.add_argument("--target", type=float, default=-0.060, help="the bar the runs are timed to")
    args = parser.parse_args(argv)
    print(curve_table(args.run_dir))
    dirs = [args.run_dir, *args.beside]
    labels = args.labels or [d.name for d in dirs]
    if len(labels) != len(dirs):
        parser.error(f"{len(dirs)} runs but {len(labels)} labels")
    if args.time_png or args.png:
        try:
            env = run_env(args.run_dir)
        except ConfigError as err:
            parser.error(str(err))
    if args.time_png:
        from ray_forge.observe.plots import returns_against_time_png

        curves = {label: evals_against_time(read_metrics(d / "metrics.jsonl")) for label, d in zip(labels, dirs)}
        if args.reference:
            ref = json.loads(args.reference.read_text().strip().splitlines()[-1])
            curves["bench.reference (one process)"] = [(ref["eval_at_s"][k], ref["evals"][k]) for k in ref["evals"]]
        print(returns_against_time_png(curves, args.time_png, f"{env.spec.name}: evaluation return against time",
                                       args.target, env.references()))
    if args.png:
        from ray_forge.observe.plots import runs_side_by_side_png

        runs = {label: read_metrics(d / "metrics.jsonl") for label, d in zip(labels, dirs)}
        print(runs_side_by_side_png(runs, args.png, f"{env.spec.name}: evaluation return", env.references()))


if __name__ == "__main__":
    main()
