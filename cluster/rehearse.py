"""Rehearse a multi-node run on one machine: two labelled Ray nodes, `ray job submit`, placement check.

    python cluster/rehearse.py [--keep-logs] [job overrides ...]

Starts a head node on 127.0.0.2 labelled ``ray_forge/pool=gpu`` (policies, trainer, reference:
CPU bundles stand in for GPUs) and a worker on 127.0.0.3 labelled ``ray_forge/pool=cpu`` (env
actors), submits the BlackJack job with ``ray job submit`` and a short configuration, then asks
Ray's state API where every actor ran. Prints a JSON object as its last line; exits 1 when the
job did not succeed or an actor ran on the wrong node. The cluster is torn down either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from ray_forge.cluster.local import LocalCluster, NodeSpec
from ray_forge.config.schema import POOL_LABEL

GPU_NODE, CPU_NODE = "127.0.0.2", "127.0.0.3"
SHORT = ["run.steps=2", "run.eval_every=2", "env.options.blackjack.mc_games=200", "grpo.prompts_per_step=8", "grpo.kl_coef=0.05",
         "run.progress=false", "model.tiny.num_layers=2", "policy.kv_cache_mb=64",
         "cluster.pool_labels.gpu=gpu", "cluster.pool_labels.cpu=cpu"]
EXPECTED_POOL = {"policy": "gpu", "trainer": "gpu", "ref": "gpu", "env": "cpu"}
"""Where each role's actors (named ``<role>-<i>``, or ``ref``) must run."""


def role(actor_name: str) -> str:
    """'policy-1' -> 'policy'; 'ref' -> 'ref'."""
    return actor_name.rsplit("-", 1)[0]


def placement(address: str) -> dict[str, dict]:
    """Every named actor the job started: its node's address and pool label (Ray's state API)."""
    from ray.util.state import list_actors, list_nodes

    nodes = {n.node_id: n for n in list_nodes(address=address, detail=True, raise_on_missing_output=False)}
    actors = list_actors(address=address, detail=True, limit=1000, raise_on_missing_output=False)
    out = {}
    for actor in actors:
        if actor.name and role(actor.name) in EXPECTED_POOL:
            node = nodes[actor.node_id]
            out[actor.name] = {"node_ip": node.node_ip, "pool": (node.labels or {}).get(POOL_LABEL),
                               "state": actor.state}
    return out


def misplaced(where: dict[str, dict]) -> list[str]:
    problems = [f"{name} ran on {info['node_ip']} (pool {info['pool']}), expected pool {EXPECTED_POOL[role(name)]}"
                for name, info in where.items() if info["pool"] != EXPECTED_POOL[role(name)]]
    found = {role(name) for name in where}
    return problems + [f"no {r} actor was found" for r in EXPECTED_POOL if r not in found]


def rehearse(overrides: list[str], output_dir: Path, timeout_s: float = 900.0) -> dict:
    nodes = [NodeSpec(GPU_NODE, num_cpus=2, labels={POOL_LABEL: "gpu"}, memory_bytes=12 * 10**9),
             NodeSpec(CPU_NODE, num_cpus=1, labels={POOL_LABEL: "cpu"}, memory_bytes=4 * 10**9)]
    start = time.monotonic()
    with LocalCluster(nodes, dashboard=True) as cluster:
        cluster.wait_for_jobs()
        # As the RayJob does: a resubmitted rehearsal continues its unfinished run.
        entrypoint = ["python", "jobs/grpo.py", "--config", "jobs/configs/blackjack_tiny.yaml", "--resume", "auto",
                      *SHORT, f"run.output_dir={output_dir}", *overrides]
        job_id, job = cluster.submit(entrypoint, ROOT, f"rehearsal-{int(time.time())}", timeout_s)
        from ray.job_submission import JobSubmissionClient

        status = str(JobSubmissionClient(cluster.dashboard_url).get_job_status(job_id).value)
        where = placement(cluster.dashboard_url)
    problems = misplaced(where) + ([] if status == "SUCCEEDED" else [f"job ended {status}"])
    return {"job_id": job_id, "status": status, "placement": where, "problems": problems,
            "seconds": round(time.monotonic() - start, 1), "log_tail": (job.stdout + job.stderr)[-3000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=str(ROOT / "runs" / "rehearsal"))
    parser.add_argument("overrides", nargs="*", help="extra job overrides, e.g. run.steps=3")
    args = parser.parse_args(argv)
    result = rehearse(args.overrides, Path(args.output_dir).resolve())
    for name, info in sorted(result["placement"].items()):
        print(f"{name:10s} {info['node_ip']:10s} pool={info['pool']}")
    print("\n".join(result["problems"]) or f"job {result['status']}, every actor on its pool")
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}))
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
