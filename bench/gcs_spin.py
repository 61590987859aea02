"""What a node lost for good costs Ray's GCS, by how its actor was placed: in a placement group
(the pools' way before issue 39) or by the node label alone (the engines' and env actors' way now).

On a local three-node cluster (a head; two nodes labelled ``gpu`` with one CPU each) two actors
take one CPU on each gpu node, either as the two bundles of one placement group or by the label;
the second's node is SIGKILLed and nothing replaces it, so Ray cannot place it again. The GCS's
and the dashboard agents' CPU use is read before the kill and over ``--watch`` seconds once Ray
has declared the node dead (from /proc, by psutil). Ray's GCS retries a placed group that lost a node it cannot replace with
no backoff (ray-project/ray#65007, #65970): it took a whole core here, and the run on the same
machine lost it. Then a node with the label joins, and the actor must come back either way.

    python bench/gcs_spin.py [--watch 20]

The last line printed is a JSON object: per placement, the GCS's and the agents' cores used after
the kill, the seconds until the actor answered again from the new node, and the ratio of the
placement group's GCS cores to the label's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ray_forge.cluster.local import LocalCluster, NodeSpec  # noqa: E402
from ray_forge.config.schema import POOL_LABEL  # noqa: E402

GPU = {POOL_LABEL: "gpu"}
NODES = [NodeSpec("127.0.0.2", num_cpus=1, memory_bytes=2 * 10**9),
         NodeSpec("127.0.0.3", num_cpus=1, labels=GPU, memory_bytes=2 * 10**9),
         NodeSpec("127.0.0.4", num_cpus=1, labels=GPU, memory_bytes=2 * 10**9)]


def cores_used(cluster: LocalCluster, seconds: float) -> dict[str, float]:
    """Cores the cluster's GCS and its dashboard agents (together) used over ``seconds``."""
    procs = {}
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if str(cluster.temp_dir) in line or "gcs_server" in line:
            if "gcs_server" in line:
                procs[proc] = "gcs"
            elif "dashboard/agent.py" in line:
                procs[proc] = "agents"
    start = {proc: sum(proc.cpu_times()[:2]) for proc in procs}
    time.sleep(seconds)
    used = {"gcs": 0.0, "agents": 0.0}
    for proc, what in procs.items():
        try:
            used[what] += (sum(proc.cpu_times()[:2]) - start[proc]) / seconds
        except psutil.NoSuchProcess:  # an agent of the killed node
            pass
    return {k: round(v, 3) for k, v in used.items()}


def lose_a_node(placement: str, watch_s: float) -> dict:
    import ray

    from ray_forge.cluster import nodes

    @ray.remote(max_restarts=5)
    class Member:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    with LocalCluster(NODES) as cluster:
        cluster.connect(log_to_driver=False)
        if placement == "placement_group":
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = placement_group([{"CPU": 1}] * 2, strategy="PACK", bundle_label_selector=[GPU] * 2)
            ray.get(group.ready(), timeout=120)
            members = [Member.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
                       for i in range(2)]
        else:
            members = [Member.options(num_cpus=1, label_selector=GPU).remote() for _ in range(2)]
        where = ray.get([m.node.remote() for m in members], timeout=120)
        before = cores_used(cluster, 5.0)
        ip = nodes.alive_address(where[1])
        spec = cluster.kill_node(cluster.node_at(ip))
        cluster.wait_for_nodes(len(NODES) - 1)  # Ray has declared it dead: from here the GCS reschedules
        after = cores_used(cluster, watch_s)
        cluster.add_node(spec)
        start = time.monotonic()
        back = ray.get(members[1].node.remote(), timeout=300)
        result = dict(before=before, after_kill=after, back_after_s=round(time.monotonic() - start, 1),
                      back_on_a_new_node=back != where[1])
        ray.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--watch", type=float, default=20.0, help="seconds to watch the GCS once the node is dead")
    args = parser.parse_args()
    results = {placement: lose_a_node(placement, args.watch) for placement in ("placement_group", "label")}
    for placement, result in results.items():
        print(placement, result, flush=True)
    spin = results["placement_group"]["after_kill"]["gcs"] / max(results["label"]["after_kill"]["gcs"], 1e-3)
    print(json.dumps(dict(results, gcs_cores_pg_vs_label=round(spin, 1), watch_s=args.watch,
                          machine=f"{psutil.cpu_count()} cores", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))))


if __name__ == "__main__":
    main()
