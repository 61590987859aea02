"""``LocalCluster`` starts its worker nodes at once, and each starts on its first try: every node
has sockets and logs of its own (in one shared directory two nodes starting together took the same
socket name, and one raylet died on "bind: Address already in use")."""

import logging

import pytest

from ray_forge.cluster.local import LocalCluster, NodeSpec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("own_ray_cluster")]

NODES = [NodeSpec(f"127.0.0.{k}", num_cpus=1, memory_bytes=10**9, object_store_bytes=10**8) for k in (2, 3, 4, 5)]


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


def test_a_head_whose_first_start_fails_is_started_again_before_any_worker(caplog, monkeypatch):
    """The head's ``ray start`` fails on its first try (its GCS port, chosen free, taken by
    another process since: here a listening socket that is not Ray). The head is started again on
    new ports, and the workers join it; before, the workers were sent to the port that answered,
    each failed three times, and the error named a worker."""
    import socket

    import ray

    from ray_forge.cluster import local

    caplog.set_level(logging.WARNING, logger="ray_forge.cluster.local")
    taken = socket.socket()
    taken.bind(("127.0.0.2", 0))
    taken.listen()
    cluster = LocalCluster(NODES[:2], start_timeout_s=60)
    ports = iter([taken.getsockname()[1]])  # the next port chosen: the head's GCS port
    real_free_port = local.free_port
    monkeypatch.setattr(local, "free_port", lambda: next(ports, None) or real_free_port())
    try:
        with cluster:
            retried = [r.getMessage() for r in caplog.records if "failed to start" in r.getMessage()]
            assert len(retried) == 1 and retried[0].startswith("node 0 (127.0.0.2)"), retried
            assert cluster.gcs_port != taken.getsockname()[1]
            cluster.connect(log_to_driver=False)
            assert sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]) == ["127.0.0.2", "127.0.0.3"]
    finally:
        taken.close()
