"""``LocalCluster`` starts its worker nodes at once, and each starts on its first try: every node
has sockets and logs of its own (in one shared directory two nodes starting together took the same
socket name, and one raylet died on "bind: Address already in use")."""

import logging

import pytest

from ray_forge.cluster.local import LocalCluster, NodeSpec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("own_ray_cluster")]

NODES = [NodeSpec(f"127.0.0.{k}", num_cpus=1, memory_bytes=10**9, object_store_bytes=10**8) for k in (2, 3, 4, 5)]


class BlockFailed(Exception):
    """A failure inside a ``with LocalCluster`` block."""


def test_worker_nodes_started_together_each_start_on_the_first_try_with_sockets_of_their_own(caplog):
    import ray

    caplog.set_level(logging.WARNING, logger="ray_forge.cluster.local")
    with LocalCluster(NODES) as cluster:
        retried = [r.getMessage() for r in caplog.records if "failed to start" in r.getMessage()]
        assert not retried, retried
        cluster.connect(log_to_driver=False)
        plasma = {n["NodeManagerAddress"]: n["ObjectStoreSocketName"] for n in ray.nodes() if n["Alive"]}
        assert sorted(plasma) == [node.ip for node in NODES]
        for index, node in enumerate(NODES):
            assert plasma[node.ip].startswith(f"{cluster.node_dir(index)}/"), (index, plasma)
        assert all(logs.is_dir() for logs in cluster.log_dirs())
    left = [path for path in cluster.files() if path.exists()]
    assert not left, left  # stopped cleanly: its sockets and logs went with it


def test_a_head_whose_first_start_fails_is_started_again_before_any_worker(caplog, monkeypatch):
    """The head's ``ray start`` fails on its first try (under load Ray's gave up after its own 30 s
    wait for the raylet, taking its GCS down; here the first try is a process that exits at once,
    so the test does not wait those 30 s). The head is started again on new ports before any worker
    is, and the workers join it; before, the workers were sent to the first head's port, each
    failed three times, and the error named a worker."""
    import shutil
    import sys

    import ray

    caplog.set_level(logging.WARNING, logger="ray_forge.cluster.local")
    spawned: list[list[str]] = []
    real_spawn = LocalCluster._spawn

    def first_head_exits(self, cmd, index=None):
        spawned.append(cmd)
        if len(spawned) == 1:  # the same arguments, to a program that says why and exits 1
            cmd = [sys.executable, "-c", "raise SystemExit('the head failed to start (injected)')", *cmd[1:]]
        real_spawn(self, cmd, index)

    monkeypatch.setattr(LocalCluster, "_spawn", first_head_exits)
    cluster = LocalCluster(NODES[:2], start_timeout_s=60)
    with pytest.raises(BlockFailed), cluster:
        retried = [r.getMessage() for r in caplog.records if "failed to start" in r.getMessage()]
        assert len(retried) == 1 and retried[0].startswith("node 0 (127.0.0.2) failed to start (rc 1"), retried
        assert ["--head" in cmd for cmd in spawned] == [True, True, False]  # both heads before the worker
        first_port, second_port = (next(a for a in cmd if a.startswith("--port=")) for cmd in spawned[:2])
        assert first_port != second_port == f"--port={cluster.gcs_port}"  # new ports for the second head
        assert f"--address=127.0.0.2:{cluster.gcs_port}" in spawned[2]
        cluster.connect(log_to_driver=False)
        assert sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]) == ["127.0.0.2", "127.0.0.3"]
        raise BlockFailed
    kept = cluster.files()  # a failure's evidence stays
    assert all(f.exists() for f in kept) and len(kept) == 5 and "node files are kept" in caplog.text  # 3 starts
    for path in kept:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
