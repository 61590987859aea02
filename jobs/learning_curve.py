"""Print a run's learning curve (exact return of the greedy policy against step and wall time) as
Markdown; with ``--beside``, also draw BlackJack runs' evaluation curves and actor restarts in one PNG.

    python jobs/learning_curve.py runs/<run>
    python jobs/learning_curve.py runs/<chaos run> --beside runs/<undisturbed run> --png side_by_side.png \
        --labels "killed every ~60 s" undisturbed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from ray_forge.metrics import read_metrics  # noqa: E402


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--beside", type=Path, nargs="*", default=[], help="other runs to draw beside it")
    parser.add_argument("--png", type=Path, help="where to draw the runs side by side")
    parser.add_argument("--labels", nargs="*", help="one legend label per run (default: the folder names)")
    args = parser.parse_args(argv)
    print(curve_table(args.run_dir))
    if args.png:
        from envs.blackjack.plots import reference_returns
        from ray_forge.plots import runs_side_by_side_png

        dirs = [args.run_dir, *args.beside]
        labels = args.labels or [d.name for d in dirs]
        if len(labels) != len(dirs):
            parser.error(f"{len(dirs)} runs but {len(labels)} labels")
        runs = {label: read_metrics(d / "metrics.jsonl") for label, d in zip(labels, dirs)}
        print(runs_side_by_side_png(runs, args.png, "BlackJack GRPO: evaluation return", reference_returns()))


if __name__ == "__main__":
    main()
