"""A lost CPU node against the run-to-run spread: does a run whose env node dies mid-run end where
undisturbed runs end?

On a local three-node cluster (``ray_forge/cluster/local.py``: a head; a gpu-labelled node with
the engines and the trainer; a cpu-labelled node with the env actor), runs the `make demo` config
``--runs`` times undisturbed, then once with the cpu node SIGKILLed after step ``--kill-at`` and a
node with its labels started ``--replace-after`` seconds later (``chaos.kill_nodes``). Every run
has a fresh cluster and the same seed. Reports each run's exact return at every evaluation, its
final weights' SHA-256, and whether the disturbed run lies within the undisturbed runs' range and
within two of their standard deviations at every evaluation. The demo plays every batch with the
newest weights and seeds every request from its games, so undisturbed runs may well agree to the
bit; then so must the disturbed one, whose lost games are replayed from the same seeds.

    python bench/node_loss_spread.py [--runs 2] [--steps 60] [--kill-at 20] [--replace-after 10] [overrides ...]

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ray_forge.cluster.local import LocalCluster, NodeSpec  # noqa: E402
from ray_forge.config.schema import POOL_LABEL  # noqa: E402

CONFIG = ROOT / "jobs/configs/blackjack_tiny.yaml"
NODES = [NodeSpec("127.0.0.2", num_cpus=1, memory_bytes=4 * 10**9),
         NodeSpec("127.0.0.3", num_cpus=2, labels={POOL_LABEL: "gpu"}, memory_bytes=10 * 10**9),
         NodeSpec("127.0.0.4", num_cpus=1, labels={POOL_LABEL: "cpu"}, memory_bytes=4 * 10**9)]


def run(out: Path, steps: int, overrides: list[str]) -> dict:
    """One demo run on a fresh three-node cluster: its evaluations, final SHA-256, losses and time."""
    import ray

    from jobs import grpo

    start = time.monotonic()
    with LocalCluster(NODES) as cluster:
        cluster.connect(log_to_driver=False)
        try:
            summary = grpo.main(["--config", str(CONFIG), f"run.steps={steps}", "run.eval_every=10",
                                 "run.progress=false", "env.options.blackjack.mc_games=1000", f"run.output_dir={out}",
                                 "cluster.pool_labels.gpu=gpu", "cluster.pool_labels.cpu=cpu", *overrides])
        finally:
            ray.shutdown()
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = (run_dir / "final_policy" / "model.safetensors").read_bytes()
    return dict(evals={r["step"]: r["eval_return"] for r in rows if r.get("eval_return") is not None},
                final=summary["exact_return"], sha256=hashlib.sha256(weights).hexdigest()[:16],
                nodes_lost=rows[-1]["nodes_lost"], replayed_games=rows[-1]["replayed_games"],
                actor_restarts=rows[-1]["actor_restarts"], seconds=round(time.monotonic() - start, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--replace-after", type=float, default=10.0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if not 0 < args.kill_at < args.steps:
        parser.error("--kill-at must be a step before --steps")
    logging.getLogger().setLevel(logging.WARNING)
    kill = f"chaos.kill_nodes=[{{holding: env-0, at_step: {args.kill_at}, replace_after_s: {args.replace_after}}}]"
    with tempfile.TemporaryDirectory() as tmp:
        plain = []
        for i in range(args.runs):
            plain.append(run(Path(tmp) / f"plain{i}", args.steps, args.overrides))
            print(f"undisturbed run {i}: {plain[-1]}", flush=True)
        lost = run(Path(tmp) / "lost", args.steps, [*args.overrides, kill])
        print(f"cpu node lost after step {args.kill_at}: {lost}", flush=True)
    steps = sorted(lost["evals"])
    low = {s: min(p["evals"][s] for p in plain) for s in steps}
    high = {s: max(p["evals"][s] for p in plain) for s in steps}
    mean = {s: statistics.mean(p["evals"][s] for p in plain) for s in steps}
    sd = {s: statistics.stdev(p["evals"][s] for p in plain) if len(plain) > 1 else 0.0 for s in steps}
    inside = [low[s] <= lost["evals"][s] <= high[s] for s in steps]
    within_2sd = [abs(lost["evals"][s] - mean[s]) <= 2 * sd[s] for s in steps]
    print(json.dumps(dict(bench="node_loss_spread", runs=args.runs, steps=args.steps, kill_at=args.kill_at,
                          replace_after_s=args.replace_after, eval_steps=steps,
                          undisturbed=[[p["evals"][s] for s in steps] for p in plain],
                          lost_node=[lost["evals"][s] for s in steps], inside=inside, within_2sd=within_2sd,
                          all_inside=all(inside), same_final_weights=all(p["sha256"] == lost["sha256"] for p in plain),
                          sha256=[p["sha256"] for p in plain] + [lost["sha256"]],
                          lost_node_counts=dict(nodes_lost=lost["nodes_lost"], replayed_games=lost["replayed_games"],
                                                actor_restarts=lost["actor_restarts"]),
                          seconds=[p["seconds"] for p in plain] + [lost["seconds"]])))


if __name__ == "__main__":
    main()
