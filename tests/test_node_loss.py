"""A whole node lost, as a preempted pod is lost: its raylet, object store and workers killed at
once (``LocalCluster.kill_node``), and a replacement with the same labels started after it."""

import time
from pathlib import Path

import pytest

from ray_forge.cluster.local import LocalCluster, NodeSpec
from ray_forge.config.schema import POOL_LABEL

pytestmark = [pytest.mark.slow, pytest.mark.ray,
              pytest.mark.usefixtures("own_ray_cluster")]  # this process joins each test's own cluster

ROOT = Path(__file__).resolve().parent.parent
HEAD, WORKER = "127.0.0.2", "127.0.0.3"


def _where(actor) -> tuple[str, int]:
    import ray

    return ray.get(actor.where.remote(), timeout=30)


def test_a_killed_node_takes_its_actors_and_a_replacement_brings_them_back():
    """An actor pinned to the cpu pool's node by a placement group dies with the node; Ray counts
    the node dead; once a node with the same label joins, the bundle is placed again and the
    actor restarts there, in a new process on the new node."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cpu = NodeSpec(WORKER, num_cpus=1, labels={POOL_LABEL: "cpu"}, memory_bytes=2 * 10**9)
    with LocalCluster([NodeSpec(HEAD, num_cpus=1, labels={POOL_LABEL: "gpu"}, memory_bytes=2 * 10**9), cpu]) as cluster:
        cluster.connect(log_to_driver=False)
        try:
            group = placement_group([{"CPU": 0.5}], bundle_label_selector=[{POOL_LABEL: "cpu"}])
            ray.get(group.ready(), timeout=120)

            @ray.remote(max_restarts=-1, max_task_retries=0)
            class Where:
                def where(self) -> tuple[str, int]:
                    import os

                    return ray.get_runtime_context().get_node_id(), os.getpid()

            actor = Where.options(num_cpus=0.5, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=0)).remote()
            first_node, first_pid = _where(actor)
            assert first_node == next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == WORKER)

            assert cluster.kill_node(1) == cpu
            assert cluster.alive() == [0]
            cluster.wait_for_nodes(1, timeout_s=120)  # the GCS noticed: no goodbye was sent
            with pytest.raises((ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
                _where(actor)  # nowhere to restart: the only node with the label is gone

            assert cluster.add_node(cpu) == 2
            cluster.wait_for_nodes(2, timeout_s=120)
            deadline = time.monotonic() + 120
            while True:
                try:
                    node, pid = _where(actor)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            replacement = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == WORKER)
            assert node == replacement != first_node
            assert pid != first_pid
        finally:
            ray.shutdown()


GPU_NODE, CPU_NODE = "127.0.0.3", "127.0.0.4"
STEPS = 10
GAMES = 64
JOB = [f"run.steps={STEPS}", "run.eval_every=5", "env.options.blackjack.mc_games=200", f"grpo.prompts_per_step={GAMES // 8}",
       "run.progress=false", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128", "model.tiny.num_layers=2",
       "policy.kv_cache_mb=64", "policy.num_replicas=1", "env.num_actors=2", "env.resources.num_cpus=0.25",
       "cluster.pool_labels.gpu=gpu", "cluster.pool_labels.cpu=cpu", "policy.call_timeout_s=120"]


def _three_nodes() -> list[NodeSpec]:
    """The head (the driver, the buffer, the weight store's controller), a gpu node (engine,
    trainer, reference; CPU bundles stand in for GPUs) and a cpu node (the env actors)."""
    return [NodeSpec(HEAD, num_cpus=1, memory_bytes=4 * 10**9),
            NodeSpec(GPU_NODE, num_cpus=2, labels={POOL_LABEL: "gpu"}, memory_bytes=10 * 10**9),
            NodeSpec(CPU_NODE, num_cpus=1, labels={POOL_LABEL: "cpu"}, memory_bytes=3 * 10**9)]


def _at_step(run_root, step: int, timeout_s: float = 600.0) -> None:
    """Until the run under ``run_root`` has logged ``step``."""
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for metrics in run_root.glob("*/metrics.jsonl"):
            lines = metrics.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        time.sleep(0.2)
    raise TimeoutError(f"the run did not reach step {step} within {timeout_s:.0f}s")


def test_a_run_whose_cpu_node_is_lost_and_replaced_completes_and_accounts_for_every_game(tmp_path, caplog):
    """The cpu node (both env actors) is killed mid-run and a node with its label joins 10 s later:
    the games in play are replayed from their seeds once the env actors are back on it, every step
    is logged, every game accounted for, and the metrics show the loss."""
    import json
    import threading

    import ray

    from jobs import grpo
    from ray_forge.actors.buffer import COUNTERS

    faults: dict = {}

    def lose_the_cpu_node() -> None:
        try:
            _at_step(tmp_path, 3)
            spec = cluster.kill_node(2)
            faults["killed"] = time.monotonic()
            time.sleep(10)
            cluster.add_node(spec)
            faults["replaced"] = time.monotonic()
        except BaseException as err:  # the test reads it: a thread's error is otherwise lost
            faults["error"] = err

    with LocalCluster(_three_nodes()) as cluster:
        cluster.connect(log_to_driver=False)
        try:
            chaos = threading.Thread(target=lose_the_cpu_node, daemon=True)
            chaos.start()
            with caplog.at_level("WARNING"):
                summary = grpo.main(["--config", str(ROOT / "jobs/configs/blackjack_tiny.yaml"),
                                     f"run.output_dir={tmp_path}", *JOB])
            chaos.join(timeout=60)
        finally:
            ray.shutdown()
    assert "error" not in faults, faults
    assert "replaced" in faults, "the node was never killed and replaced: the run ended first"
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:  # generated = trained + evicted as stale + dropped + still buffered, at every step
        assert row["generated"] == sum(row[k] for k in COUNTERS[1:]) + row["buffer_size"], row
    last = rows[-1]
    assert last["nodes_lost"] == 1, last
    assert last["actor_restarts"] >= 2 and last["replayed_games"] > 0, last  # both env actors came back
    assert last["trained"] + last["dropped_no_signal"] == STEPS * GAMES
    assert f"at {CPU_NODE} (pool cpu) was lost" in caplog.text
    assert (Path(summary["run_dir"]) / "final_policy" / "model.safetensors").is_file()
