"""The weight store: bucket layout, exact transfers, dtype conversion, eviction, and lost peers."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import torch

from ray_forge.weights import StoreSpec, TransportUnavailable, WeightStore, WeightSyncError
from ray_forge.weights.layout import pack_into, plan_buckets, unpack

MiB = 2**20


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """12 fp32 matrices of 256 KiB (4 per 1 MiB bucket), an odd-sized one and an int buffer."""
    gen = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.weight": torch.randn(256, 256, generator=gen) for i in range(12)}
    sd["norm.weight"] = torch.randn(77, generator=gen)
    sd["position_ids"] = torch.arange(33)
    return sd


def spec_for(transport: str, **kw) -> StoreSpec:
    return StoreSpec(name=f"test-{uuid.uuid4().hex[:8]}", transport=transport, bucket_bytes=MiB, **kw)


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name].view(torch.uint8) if got[name].is_floating_point() else got[name],
                           want[name].view(torch.uint8) if want[name].is_floating_point() else want[name]), name


# -- layout (no Ray) -----------------------------------------------------------------------------
def test_buckets_respect_the_size_and_alignment():
    sd = state_dict()
    buckets = plan_buckets(sd, MiB)
    assert [len(b.tensors) for b in buckets] == [4, 4, 4, 2]
    assert all(b.nbytes <= MiB for b in buckets)
    assert all(t.offset % 64 == 0 for b in buckets for t in b.tensors)
    assert [t.name for b in buckets for t in b.tensors] == list(sd)


def test_a_tensor_larger_than_the_bucket_travels_alone():
    sd = {"a": torch.ones(10), "big": torch.ones(2 * MiB // 4), "c": torch.ones(3)}
    assert [[t.name for t in b.tensors] for b in plan_buckets(sd, MiB)] == [["a"], ["big"], ["c"]]


@pytest.mark.parametrize("dtype", ["", "bfloat16", "float16"])
def test_pack_and_unpack_round_trip_and_convert_like_to(dtype):
    sd = state_dict()
    for bucket in plan_buckets(sd, MiB, dtype):
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
        pack_into(bucket, sd, buffer)
        for name, view in unpack(bucket, buffer):
            want = sd[name].to(getattr(torch, dtype)) if dtype and sd[name].is_floating_point() else sd[name]
            assert_bitwise({name: view}, {name: want})


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="unknown weight transport"):
        StoreSpec(name="x", transport="carrier_pigeon")
    with pytest.raises(ValueError, match="keep_versions"):
        StoreSpec(name="x", transport="shm", keep_versions=0)
    with pytest.raises(ValueError, match="not a torch dtype"):
        StoreSpec(name="x", transport="shm", dtype="bfloat17")


def test_unavailable_transports_say_what_is_missing():
    with pytest.raises(TransportUnavailable, match="torchstore"):
        WeightStore(spec_for("torchstore"))
    if not torch.cuda.is_available():
        with pytest.raises(TransportUnavailable, match="CUDA"):
            WeightStore(spec_for("nccl"))


# -- through Ray ---------------------------------------------------------------------------------
def _actor_classes():
    import ray

    @ray.remote(num_cpus=0)
    class Sender:
        def put(self, spec: StoreSpec, version: int, seed: int) -> int:
            return WeightStore(spec).put_state_dict(version, state_dict(seed)).nbytes

    @ray.remote(num_cpus=0)
    class Receiver:
        def get(self, spec: StoreSpec, version: int, dtype: str = "") -> dict[str, torch.Tensor]:
            convert = getattr(torch, dtype) if dtype else None
            into = {k: torch.full_like(v, 7, dtype=convert if convert and v.is_floating_point() else v.dtype)
                    for k, v in state_dict().items()}
            return WeightStore(spec).get_state_dict(version, into=into)

        def slow_read(self, spec: StoreSpec, version: int, marker: str, pause_s: float) -> int:
            """Read the first bucket, say so, wait (the test kills the sender then), read the rest."""
            names = []
            for name, _ in WeightStore(spec).iter_state_dict(version):
                names.append(name)
                if len(names) == 1:
                    Path(marker).touch()
                    time.sleep(pause_s)
            return len(names)

    return Sender, Receiver


@pytest.fixture(scope="module")
def peers(ray_cluster):
    """One sender and two receivers, each its own process, shared by the tests (starting one costs seconds)."""
    Sender, Receiver = _actor_classes()
    sender, receivers = Sender.remote(), [Receiver.remote() for _ in range(2)]
    yield Sender, sender, receivers
    for actor in [sender, *receivers]:
        ray_cluster.kill(actor)


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_two_receivers_get_bitwise_copies_in_place(ray_cluster, peers, transport):
    _, sender, receivers = peers
    store = WeightStore.create(spec_for(transport))
    try:
        assert ray_cluster.get(sender.put.remote(store.spec, 1, seed=1), timeout=60) > 3 * MiB
        for got in ray_cluster.get([r.get.remote(store.spec, 1) for r in receivers], timeout=60):
            assert_bitwise(got, state_dict(1))
        # The driver (another process) reads it too, into fresh tensors.
        assert_bitwise(store.get_state_dict(1), state_dict(1))
        assert store.keys(1)[0] == "policy_ver_0000000001.layers.0.weight"
    finally:
        store.destroy()


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_dtype_conversion_on_the_way_equals_to(ray_cluster, peers, transport):
    _, sender, (receiver, _) = peers
    to = {dtype: {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict(3).items()}
          for dtype in (torch.bfloat16, torch.float16)}
    converting = WeightStore.create(spec_for(transport, dtype="bfloat16"))
    plain = WeightStore.create(spec_for(transport))
    try:
        ray_cluster.get(sender.put.remote(converting.spec, 3, seed=3), timeout=60)
        assert_bitwise(ray_cluster.get(receiver.get.remote(converting.spec, 3, "bfloat16"), timeout=60),
                       to[torch.bfloat16])
        # fp32 on the wire, fp16 in the receiver: the in-place copy converts exactly like .to().
        ray_cluster.get(sender.put.remote(plain.spec, 3, seed=3), timeout=60)
        assert_bitwise(ray_cluster.get(receiver.get.remote(plain.spec, 3, "float16"), timeout=60),
                       to[torch.float16])
    finally:
        converting.destroy()
        plain.destroy()


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_old_versions_are_evicted(ray_cluster, peers, transport):
    _, sender, _ = peers
    store = WeightStore.create(spec_for(transport, keep_versions=2, timeout_s=5))
    try:
        for version in (1, 2, 3):
            ray_cluster.get(sender.put.remote(store.spec, version, seed=version), timeout=60)
        assert store.versions() == [2, 3]
        with pytest.raises(WeightSyncError, match="version 1 .*evicted"):
            store.get_state_dict(1)
        assert_bitwise(store.get_state_dict(3), state_dict(3))
        if transport == "shm":
            assert sorted(p.name for p in store.transport.root.iterdir()) == [
                "policy_ver_0000000002", "policy_ver_0000000003"]
        store.delete(2)
        assert store.versions() == [3]
    finally:
        store.destroy()
    if transport == "shm":
        assert not store.transport.root.exists()


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_views_stay_valid_after_the_reader_moves_on(ray_cluster, peers, transport):
    """vLLM's loader may hold tensors of earlier buckets; releasing a bucket's pages must not change them."""
    _, sender, _ = peers
    store = WeightStore.create(spec_for(transport))
    try:
        ray_cluster.get(sender.put.remote(store.spec, 1, seed=5), timeout=60)
        held = dict(store.iter_state_dict(1))  # every view kept past its bucket
        assert_bitwise({k: v.clone() for k, v in held.items()}, state_dict(5))
    finally:
        store.destroy()


def stalled_read(receiver, spec: StoreSpec, version: int, marker: Path, pause_s: float):
    """Start a read that stops after its first bucket for ``pause_s``; returns once it has stopped."""
    pending = receiver.slow_read.remote(spec, version, str(marker), pause_s)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the receiver never read its first bucket"
    return pending


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_the_sender_never_waits_for_a_slow_receiver(ray_cluster, peers, transport, tmp_path):
    """A receiver stalls mid-read while the sender publishes two more versions: every put returns
    promptly; the stalled read then fails clearly (shm: its files were freed) or, where the bytes
    are still referenced (object store), completes with the right data."""
    _, sender, (receiver, _) = peers
    store = WeightStore.create(spec_for(transport, keep_versions=2, timeout_s=30))
    try:
        ray_cluster.get(sender.put.remote(store.spec, 1, seed=1), timeout=60)
        stalled = stalled_read(receiver, store.spec, 1, tmp_path / "stalled", pause_s=4.0)
        start = time.monotonic()
        for version in (2, 3):
            ray_cluster.get(sender.put.remote(store.spec, version, seed=version), timeout=60)
        assert time.monotonic() - start < 4.0, "a put waited for the stalled receiver"
        assert store.versions() == [2, 3]
        if transport == "shm":
            with pytest.raises(Exception, match="version 1 from trainer-0 was deleted while being read"):
                ray_cluster.get(stalled, timeout=60)
        else:
            assert ray_cluster.get(stalled, timeout=60) == len(state_dict())
    finally:
        store.destroy()


@pytest.mark.ray
def test_killing_the_sender_mid_transfer_fails_the_receiver_naming_it(ray_cluster, peers, tmp_path):
    Sender, _, (receiver, _) = peers
    store = WeightStore.create(spec_for("object_store", timeout_s=20))
    sender = Sender.remote()  # its own: this one gets killed
    try:
        ray_cluster.get(sender.put.remote(store.spec, 1, seed=1), timeout=60)
        pending = stalled_read(receiver, store.spec, 1, tmp_path / "first_bucket_read", pause_s=3.0)
        ray_cluster.kill(sender)
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            ray_cluster.get(pending, timeout=60)
        assert time.monotonic() - start < store.spec.timeout_s
        assert "WeightSyncError" in str(info.value) and "trainer-0" in str(info.value)
        assert "version 1" in str(info.value)
    finally:
        store.destroy()


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_a_version_that_never_comes_times_out_naming_the_sender(ray_cluster, transport):
    store = WeightStore.create(spec_for(transport, timeout_s=2))
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="version 9 from trainer-0 .*did not publish it within 2s"):
            store.get_state_dict(9)
        assert time.monotonic() - start < 10
    finally:
        store.destroy()
