"""A whole node lost, as a preempted pod is lost: its raylet, object store and workers killed at
once (``chaos.kill_nodes``, by ``LocalCluster.kill_node``), with or without a replacement node
with the same labels joining after it."""

import re
from pathlib import Path

import pytest

from ray_forge.cluster.local import LocalCluster, NodeSpec
from ray_forge.config.schema import POOL_LABEL
from engine_loss import paced_after_the_loss

pytestmark = [pytest.mark.slow, pytest.mark.ray,
              pytest.mark.usefixtures("own_ray_cluster")]  # this process joins each test's own cluster

ROOT = Path(__file__).resolve().parent.parent
HEAD = "127.0.0.2"


GPU_NODE, CPU_NODE, GPU_NODE_2 = "127.0.0.3", "127.0.0.4", "127.0.0.5"
# Head labelled cpu (the driver, trainer, env actor, buffer); two gpu nodes that fit one engine each.
TWO_ENGINE_NODES = [NodeSpec(HEAD, num_cpus=2, labels={POOL_LABEL: "cpu"}, memory_bytes=8 * 10**9),
                    NodeSpec(GPU_NODE, num_cpus=1, labels={POOL_LABEL: "gpu"}, memory_bytes=4 * 10**9),
                    NodeSpec(GPU_NODE_2, num_cpus=1, labels={POOL_LABEL: "gpu"}, memory_bytes=4 * 10**9)]
TWO_ENGINES = ["policy.num_replicas=2", "policy.resources.num_cpus=1", "trainer.resources.pool=cpu", "env.num_actors=1"]
STEPS = 10
GAMES = 64
JOB = [f"run.steps={STEPS}", "run.eval_every=5", "env.options.blackjack.mc_games=200", f"grpo.prompts_per_step={GAMES // 8}",
       "run.progress=false", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128", "model.tiny.num_layers=2",
       "policy.kv_cache_mb=64", "cluster.pool_labels.gpu=gpu", "cluster.pool_labels.cpu=cpu"]


def _run(cluster: LocalCluster, tmp_path: Path, caplog, *overrides: str) -> tuple[dict, list[dict]]:
    """``jobs/grpo.py`` on ``cluster`` (joined here, so that ``chaos.kill_nodes`` can kill its nodes):
    its summary and its metrics rows."""
    import json

    import ray

    from jobs import grpo

    cluster.connect(log_to_driver=False)
    try:
        with caplog.at_level("WARNING"):
            summary = grpo.main(["--config", str(ROOT / "jobs/configs/blackjack_tiny.yaml"),
                                 f"run.output_dir={tmp_path}", *JOB, *overrides])
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def _accounted(rows: list[dict]) -> None:
    """Every step logged, and every game accounted for at every step."""
    from ray_forge.actors.buffer import COUNTERS

    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:  # generated = trained + evicted as stale + dropped + still buffered, at every step
        assert row["generated"] == sum(row[k] for k in COUNTERS[1:]) + row["buffer_size"], row
    assert rows[-1]["trained"] + rows[-1]["dropped_no_signal"] == STEPS * GAMES  # each step took one batch's worth


def test_a_run_whose_cpu_node_is_lost_and_replaced_completes_and_accounts_for_every_game(tmp_path, caplog):
    """Head (the driver, the buffer, the weight store's controller); a gpu node (engine, trainer,
    reference; CPU bundles stand in for GPUs); a cpu node with both env actors. The cpu node is
    killed after step 3 and a node with its label joins 10 s later: the env actors restart on it,
    the games in play are replayed from their seeds, and the metrics show the loss."""
    nodes = [NodeSpec(HEAD, num_cpus=1, memory_bytes=4 * 10**9),
             NodeSpec(GPU_NODE, num_cpus=2, labels={POOL_LABEL: "gpu"}, memory_bytes=10 * 10**9),
             NodeSpec(CPU_NODE, num_cpus=1, labels={POOL_LABEL: "cpu"}, memory_bytes=3 * 10**9)]
    with LocalCluster(nodes) as cluster:
        summary, rows = _run(cluster, tmp_path, caplog, "policy.num_replicas=1", "env.num_actors=2",
                             "env.resources.num_cpus=0.25", "policy.call_timeout_s=120",
                             "chaos.kill_nodes=[{holding: env-0, at_step: 3, replace_after_s: 10}]")
    _accounted(rows)
    last = rows[-1]
    assert last["nodes_lost"] == 1, last
    # Both env actors came back: by the run's end, which waits for members restarting. The last
    # step may come before the second does (the run goes on with one; 1 at step 10, once).
    assert summary["actor_restarts"] >= 2 and summary["replayed_games"] > 0, summary
    assert f"chaos: killing node 2 at {CPU_NODE}" in caplog.text
    assert f"chaos: node 3 joined at {CPU_NODE}" in caplog.text
    assert f"at {CPU_NODE} (pool cpu) was lost" in caplog.text
    assert "env-0 restarted" in caplog.text and "env-1 restarted" in caplog.text
    assert summary["engines_lost"] == [] and summary["policy_versions"] == [STEPS + 1]
    assert (Path(summary["run_dir"]) / "final_policy" / "model.safetensors").is_file()


def test_a_run_that_loses_one_of_two_engines_for_good_completes_on_the_other(tmp_path, caplog):
    """Head (labelled cpu: the driver, trainer, env actor, buffer); two gpu nodes that fit one
    engine each. policy-1's node is killed after step 3 and nothing replaces it: its games are
    replayed on policy-0, the run goes on with one engine, says so, and ends with every game
    accounted for; the lost engine is named in the summary and left out of the weight syncs.
    The steps after the loss run at the pace of those before: no version waits for the lost
    engine's reads (over NIXL its refs may stay counted by Ray for good), Ray's GCS does not spin
    on a group it cannot place, and the driver asks the lost engine once per rejoin check. The
    weights go over NIXL (auto across nodes); over shared memory, which needs one node,
    ``test_chaos`` loses an engine for good by killing it with no restarts left."""
    from ray_forge.run.fleet import REJOIN_CHECK_S

    with LocalCluster(TWO_ENGINE_NODES) as cluster:
        summary, rows = _run(cluster, tmp_path, caplog, *TWO_ENGINES, "policy.call_timeout_s=60",
                             "chaos.kill_nodes=[{holding: policy-1, at_step: 3}]")
        [killed_ip] = re.findall(r"chaos: killing node \d at (\S+) ", caplog.text)
        probes, down_s = _calls_to_the_lost_engine(cluster, killed_ip, caplog)
    _accounted(rows)
    last = rows[-1]
    # Down at the last step: restarting, or already left out (the run may end before its 60 s pass).
    assert last["actors_restarting"] + last["actors_lost"] == 1, last
    # Ray declares the node dead by missed heartbeats, which on a busy machine can come after the
    # last step; the run's end waits the engine's 60 s out, so its summary shows the loss.
    assert summary["nodes_lost"] == 1 and summary["actors_lost"] == 1 and summary["actors_restarting"] == 0, summary
    assert "policy-1 is not back after 60s" in caplog.text  # by the run's end, which waited for no more
    assert "the run goes on with 1 of 2 policy actors" in caplog.text
    assert summary["engines_lost"] == ["policy-1"] and summary["policy_versions"] == [STEPS + 1]
    assert summary["weight_transport"] == "nixl", summary["weight_transport"]
    assert (Path(summary["run_dir"]) / "final_policy" / "model.safetensors").is_file()

    paced_after_the_loss(rows, rows[:3], caplog.text)
    # From Ray's own log of the driver's tasks: one probe per rejoin check while it was down.
    print(f"{probes} calls to the lost engine in {down_s:.0f}s")  # shown by pytest -rP
    assert 1 <= probes <= down_s / REJOIN_CHECK_S + 2, (probes, down_s)


def _calls_to_the_lost_engine(cluster: LocalCluster, killed_ip: str, caplog) -> tuple[int, float]:
    """How many tasks the driver submitted to the actor on the killed node after the kill, from the
    driver's own core-worker log (Ray logs each task's end with its id, which ends with its
    actor's id), and for how many seconds it was down then (kill to the run's end)."""
    import os
    import time

    [driver_log] = [log for logs in cluster.log_dirs() for log in logs.glob(f"python-core-driver-*_{os.getpid()}.log")]
    text = driver_log.read_text(errors="replace")
    [actor] = set(re.findall(rf"state: ALIVE, ip address: {re.escape(killed_ip)},.*?actor_id=(\w+)", text))
    killed = next(r.created for r in caplog.records if "chaos: killing node" in r.getMessage())
    tasks = set()
    for line in text.splitlines():
        stamp = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+)", line)
        if stamp and time.mktime(time.strptime(stamp[1], "%Y-%m-%d %H:%M:%S")) + int(stamp[2]) / 1000 > killed:
            tasks.update(t for t in re.findall(r"task_id=(\w+)", line) if t.endswith(actor))
    return len(tasks), time.time() - killed


def test_an_engine_whose_node_is_lost_and_replaced_comes_back_and_syncs(tmp_path, caplog):
    """As above, but a node with the lost one's labels joins 10 s later: Ray starts policy-1 on it,
    the engine loads the newest weights from the store, the fleet brings it to its version, and
    the run ends with both engines on the final weights and none lost."""
    with LocalCluster(TWO_ENGINE_NODES) as cluster:
        summary, rows = _run(cluster, tmp_path, caplog, *TWO_ENGINES, "policy.call_timeout_s=300",
                             "chaos.kill_nodes=[{holding: policy-1, at_step: 3, replace_after_s: 10}]")
    _accounted(rows)
    [killed_ip] = re.findall(r"chaos: killing node \d at (\S+) ", caplog.text)  # whichever gpu node held it
    assert killed_ip in (GPU_NODE, GPU_NODE_2) and f"chaos: node 3 joined at {killed_ip}" in caplog.text
    assert "policy-1 restarted" in caplog.text  # met by the fleet: a new process, on the new node
    # The run's end waits for it (its 300 s are not up): back, synced, and not left out.
    assert summary["nodes_lost"] == 1 and summary["actor_restarts"] >= 1, summary
    assert summary["actors_lost"] == 0 and summary["actors_restarting"] == 0, summary
    assert summary["engines_lost"] == [] and summary["policy_versions"] == [STEPS + 1, STEPS + 1], summary


def test_a_run_whose_trainer_node_is_lost_stops_naming_the_rank_and_node_and_resumes(tmp_path, caplog):
    """The gpu node (engine and trainer rank 0) is killed after step 4: the job stops within
    ``trainer.call_timeout_s`` with one line naming the rank, its node and the resume command; the
    checkpoints live in ``run.output_dir`` (here the head's disk, which every node shares; on a
    cluster, the RayJob's PVC), so once a gpu node is back ``--resume auto`` finishes the run."""
    import time

    from ray_forge.core import checkpoint
    from ray_forge.run.command_line import RunStopped

    gpu = NodeSpec(GPU_NODE, num_cpus=2, labels={POOL_LABEL: "gpu"}, memory_bytes=10 * 10**9)
    nodes = [NodeSpec(HEAD, num_cpus=1, memory_bytes=4 * 10**9), gpu,
             NodeSpec(CPU_NODE, num_cpus=1, labels={POOL_LABEL: "cpu"}, memory_bytes=3 * 10**9)]
    timeout_s = 60
    job = ["policy.num_replicas=1", "env.num_actors=1", "run.checkpoint_every=2", f"trainer.call_timeout_s={timeout_s}",
           "policy.call_timeout_s=60"]
    with LocalCluster(nodes) as cluster:
        with pytest.raises(RunStopped) as stopped:
            _run(cluster, tmp_path, caplog, *job, "chaos.kill_nodes=[{holding: trainer-0, at_step: 4}]")
        ended = time.time()
        [killed] = [r.created for r in caplog.records if "chaos: killing node 1" in r.getMessage()]
        message = str(stopped.value)
        [run_dir] = [p.parent for p in tmp_path.glob("*/config.yaml")]
        assert message.startswith("trainer-0.") and "the actor died" in message, message
        assert f"on node {GPU_NODE} (" in message and ", lost" in message, message  # its raylet is gone
        assert message.endswith(f"resume with: python jobs/grpo.py --resume {run_dir}"), message
        assert "\n" not in message
        assert ended - killed < timeout_s + 30, (ended - killed, message)
        print(f"stopped {ended - killed:.0f}s after the kill: {message}")  # shown by pytest -rP
        assert checkpoint.step_of(checkpoint.latest(run_dir)) >= 2  # where the resumed run goes on from

        cluster.add_node(gpu)  # capacity returns
        caplog.clear()
        summary, rows = _run(cluster, tmp_path, caplog, *job, "--resume", "auto")
    assert summary["run_dir"] == str(run_dir)
    assert "chaos: killing" not in caplog.text  # the kill of step 4 happened before the resumed step
    _accounted(rows)
