"""Print a run's learning curve (exact return of the greedy policy against step and wall time) as Markdown.

    python jobs/learning_curve.py runs/<run>
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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    print(curve_table(parser.parse_args(argv).run_dir))


if __name__ == "__main__":
    main()
