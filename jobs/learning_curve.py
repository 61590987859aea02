"""Print a run's learning curve (exact return of the greedy policy against step and wall time) as
Markdown; with ``--beside``, also draw BlackJack runs' evaluation curves and actor restarts in one PNG.

    python jobs/learning_curve.py runs/<run>
    python jobs/learning_curve.py runs/<chaos run> --beside runs/<undisturbed run> --png side_by_side.png \
        --labels "killed every ~60 s" undisturbed
    python jobs/learning_curve.py runs/<after> --beside runs/<before> --time-png timed.png --labels after before \
        --reference reference.json --target -0.060     # return against seconds since the first step
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from ray_forge.observe.metrics import read_metrics  # noqa: E402


def curve_table(run_dir: Path) -> str:
    lines = ["| step | games | wall time | exact return | agreement with optimal |", "|---:|---:|---:|---:|---:|"]
    games = 0
    for r in read_metrics(run_dir / "metrics.jsonl"):
        games += r.get("num_games", 0)
        if r.get("eval_return") is None:
            continue
        minutes, seconds = divmod(int(r["wall_time_s"]), 60)
        lines.append(f"| {r['step']} | {games:,} | {minutes}:{seconds:02d} | {r['eval_return']:.4f} | "
                     f"{r.get('eval_agreement', float('nan')):.3f} |")
    final = run_dir / "eval.json"
    if final.is_file():
        result = json.loads(final.read_text())
        lines.append("")
        lines.append(f"Final policy: exact return **{result['exact_return']:.4f}**, Monte Carlo "
                     f"{result.get('mc_return', float('nan')):.4f} ± {result.get('mc_stderr', float('nan')):.4f}, "
                     f"agreement {result['agreement']:.3f}.")
    return "\n".join(lines)


def evals_against_time(rows: list[dict]) -> list[tuple[float, float]]:
    """(seconds since the first step began, exact return) of every evaluation of a run."""
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
    if args.time_png:
        from envs.blackjack.plots import reference_returns
        from ray_forge.observe.plots import returns_against_time_png

        curves = {label: evals_against_time(read_metrics(d / "metrics.jsonl")) for label, d in zip(labels, dirs)}
        if args.reference:
            ref = json.loads(args.reference.read_text().strip().splitlines()[-1])
            curves["bench.reference (one process)"] = [(ref["eval_at_s"][k], ref["evals"][k]) for k in ref["evals"]]
        print(returns_against_time_png(curves, args.time_png, "BlackJack GRPO: exact return against time",
                                       args.target, reference_returns()))
    if args.png:
        from envs.blackjack.plots import reference_returns
        from ray_forge.observe.plots import runs_side_by_side_png

        runs = {label: read_metrics(d / "metrics.jsonl") for label, d in zip(labels, dirs)}
        print(runs_side_by_side_png(runs, args.png, "BlackJack GRPO: evaluation return", reference_returns()))


if __name__ == "__main__":
    main()
