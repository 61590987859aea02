"""A receiver that dies with its node while it holds a version, and never comes back, does not stop
the sender: the run tells the weight store the receiver is gone (``Fleet._forget_if_gone``, once
the node is lost), and the next versions are published without waiting for it, over every
transport that keeps versions for their readers. Over NIXL the sender's buffers stay referenced
in Ray's count by such a receiver; a run whose lost engine held them stopped publishing."""

import os
import time
import uuid
from pathlib import Path

import pytest
import torch

from ray_forge.cluster import nodes
from ray_forge.cluster.local import LocalCluster, NodeSpec
from ray_forge.config.schema import POOL_LABEL
from ray_forge.weights import StoreSpec, WeightStore
from ray_forge.weights.controller import ControllerClient
from ray_forge.weights.nixl import REF_GRACE_S

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.usefixtures("own_ray_cluster_for_module")]

HEAD = NodeSpec("127.0.0.2", num_cpus=2, memory_bytes=4 * 10**9, labels={POOL_LABEL: "head"})
ON_HEAD = {POOL_LABEL: "head"}  # the sender and the reader outlive the receiver's node
MiB = 2**20


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(256, 256, generator=gen) for i in range(8)}


@pytest.fixture(scope="module")
def cluster():
    """The head, with the sender and a reader on it, made before any node is lost: Ray may send
    an actor's creation to a lost node's raylet until it has declared the node dead."""
    import ray

    tests = Path(__file__).resolve().parent
    with LocalCluster([HEAD]) as local:  # the actors' classes live in this file
        local.connect(log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": f"{tests.parent}:{tests}"}})
        Sender, Receiver, Reader = _actors()
        yield local, Sender.options(label_selector=ON_HEAD).remote(), Reader.options(label_selector=ON_HEAD).remote(), \
            Receiver
        ray.shutdown()


def _actors():
    import ray

    @ray.remote(num_cpus=0)
    class Sender:
        def put(self, spec: StoreSpec, version: int) -> float:
            store = self.__dict__.setdefault(spec, WeightStore(spec))  # one client per store, as a trainer rank
            start = time.monotonic()
            store.put_state_dict(version, state_dict(version))
            return time.monotonic() - start

    @ray.remote(num_cpus=0)
    class Receiver:
        """An engine in the middle of reading: it took the version's manifest (its refs) as a
        named reader and had not said it was done when its node died."""

        def __init__(self, spec: StoreSpec) -> None:
            self.store, self.held = WeightStore(spec), []

        def hold(self, version: int, member: str) -> int:
            reader = (member, os.getpid())
            self.held.append(self.store.client.manifest(version, time.monotonic() + 60, reader))
            return os.getpid()

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=0)
    class Reader:
        def get(self, spec: StoreSpec, version: int) -> dict[str, torch.Tensor]:
            return WeightStore(spec).get_state_dict(version)

    return Sender, Receiver, Reader


@pytest.mark.parametrize("transport", ["shm", "object_store", "nixl"])
def test_a_receiver_lost_with_its_node_while_holding_versions_does_not_stop_the_next_three(cluster, transport):
    import ray

    cluster, sender, reader, Receiver = cluster
    label = f"receiver-{transport}"
    ip = {"shm": "127.0.0.3", "object_store": "127.0.0.4", "nixl": "127.0.0.5"}[transport]  # each its own node
    index = cluster.add_node(NodeSpec(ip, num_cpus=1, labels={POOL_LABEL: label}, memory_bytes=2 * 10**9))
    spec = StoreSpec(name=f"loss-{uuid.uuid4().hex[:8]}", transport=transport, bucket_bytes=MiB, keep_versions=2,
                     timeout_s=30)
    store = WeightStore.create(spec)
    receiver = Receiver.options(label_selector={POOL_LABEL: label}).remote(spec)
    try:
        for version in (1, 2):
            ray.get(sender.put.remote(spec, version), timeout=60)
            pid = ray.get(receiver.hold.remote(version, "policy-1"), timeout=60)
        node = ray.get(receiver.node_id.remote(), timeout=60)
        cluster.kill_node(index)
        assert nodes.lost(node)  # what the fleet asks before it tells the store (its raylet is gone)
        ControllerClient(spec).ask(ControllerClient(spec).handle.receiver_gone.remote("policy-1", pid), "receiver_gone")
        seconds = [ray.get(sender.put.remote(spec, version), timeout=60) for version in (3, 4, 5)]
        assert max(seconds) < REF_GRACE_S, seconds  # none waited for the lost receiver's refs
        assert store.versions() == [4, 5]
        start = time.monotonic()
        got = ray.get(reader.get.remote(spec, 5), timeout=60)
        assert time.monotonic() - start < REF_GRACE_S  # nor did a live reader's read
        assert all(torch.equal(got[k], v) for k, v in state_dict(5).items())
    finally:
        ray.kill(receiver)
        store.destroy()
        cluster.wait_for_nodes(1)  # Ray has declared the lost node dead: the next test's actors avoid it
