"""The weight store: bucket layout, exact transfers, dtype conversion, eviction, and lost peers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from ray_forge.weights import StoreSpec, TransportUnavailable, WeightStore, WeightSyncError
from ray_forge.weights.layout import Piece, assemble, pack_into, plan_buckets, plan_groups, plan_pieces, unpack
from ray_forge.weights.shards import chunk_rows, split_fused_qkv
import tiny_configs

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


def test_nixl_agents_made_here_wait_instead_of_spinning():
    """NIXL's Python API starts an agent's progress thread with no delay: it spins on a core.
    The nixl transport makes the agents of its process wait between looks (they still wake on
    UCX's events): an idle agent then takes a small share of one core."""
    import os

    from nixl._api import nixl_agent, nixl_agent_config

    from ray_forge.weights.nixl import PROGRESS_DELAY_US, calm_progress_thread

    calm_progress_thread()
    agent = nixl_agent(f"calm-{uuid.uuid4().hex[:6]}", nixl_agent_config(backends=["UCX"]))
    before = os.times()
    time.sleep(2.0)
    after = os.times()
    cpu_s = (after.user - before.user) + (after.system - before.system)
    assert PROGRESS_DELAY_US >= 1000 and cpu_s < 0.5, f"an idle NIXL agent took {cpu_s:.2f} s of CPU in 2 s"
    del agent


def test_ucx_folders_of_killed_processes_are_swept_and_live_ones_kept(tmp_path):
    """A killed process never runs its exit hook: the next one here removes its empty folder, and
    keeps a live process's folder and any folder that still holds a file."""
    from ray_forge.weights.nixl import sweep_ucx_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"ray_forge-ucx-{gone.pid}-abc"
    dead_with_file = tmp_path / f"ray_forge-ucx-{gone.pid}-def"
    live = tmp_path / f"ray_forge-ucx-{os.getpid()}-ghi"
    other = tmp_path / "ray_forge-ucx-notapid-jkl"
    for path in (dead, dead_with_file, live, other):
        path.mkdir()
    (dead_with_file / "x.dot").write_text("")
    assert sweep_ucx_dirs(tmp_path) == [dead]
    assert not dead.exists() and dead_with_file.exists() and live.exists() and other.exists()


def test_unavailable_transports_say_what_is_missing():
    with pytest.raises(TransportUnavailable, match="torchstore"):
        WeightStore(spec_for("torchstore"))
    with pytest.raises(ValueError, match="replaced by 'collective'"):
        spec_for("nccl")


def test_auto_is_shared_memory_on_one_node_and_nixl_across_nodes():
    from ray_forge.weights import resolve_transport

    assert resolve_transport("auto", ["a", "a"], ["a", "a"]) == "shm"
    assert resolve_transport("auto", ["a", "b"], ["a"]) == "nixl"  # rank 1 writes its shards on b
    assert resolve_transport("auto", ["a"], ["a", "b"]) == "nixl"
    assert resolve_transport("nccl", ["a"], ["a"]) == "collective"  # the old name
    assert resolve_transport("collective", ["a"], ["b"]) == "collective"
    assert resolve_transport("object_store", ["a"], ["b"]) == "object_store"  # every one stays selectable


def test_auto_across_nodes_takes_the_object_store_where_nixl_does_not_import(monkeypatch):
    import sys

    from ray_forge.weights import resolve_transport

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # what an install without NIXL looks like
    assert resolve_transport("auto", ["a"], ["b"]) == "object_store"
    assert resolve_transport("auto", ["a"], ["a"]) == "shm"


# -- shards (no Ray) -----------------------------------------------------------------------------
def chunk_pieces(sd: dict[str, torch.Tensor], rank: int, world_size: int) -> list[Piece]:
    """What an FSDP2 rank holds of ``sd``: torch.chunk's rows of every tensor (None where it has none)."""
    pieces = []
    for name, t in sd.items():
        start, count = chunk_rows(t.shape[0], world_size, rank)
        pieces.append(Piece(name, tuple(t.shape), t.dtype, start, t[start:start + count] if count else None))
    return pieces


def packed(pieces: list[Piece], bucket_bytes: int, dtype: str = "") -> list:
    """(bucket, its bytes) for each of one sender's buckets."""
    tensors = {p.key: p.tensor for p in pieces if p.tensor is not None}
    out = []
    for bucket in plan_pieces(pieces, bucket_bytes, dtype):
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
        pack_into(bucket, tensors, buffer)
        out.append((bucket, buffer))
    return out


def in_group_order(per_rank: list[list]) -> list:
    groups = sorted({b.index for buckets in per_rank for b, _ in buckets})
    return [(b, buf) for g in groups for buckets in per_rank for b, buf in buckets if b.index == g]


@pytest.mark.parametrize("num_rows, world_size", [(17, 2), (5, 4), (2, 3), (1, 2), (9, 1), (0, 2)])
def test_chunk_rows_are_torch_chunks(num_rows, world_size):
    """FSDP2 shards dim 0 with torch.chunk, which may hand high ranks fewer rows or none."""
    chunks = torch.arange(num_rows).chunk(world_size) if num_rows else ()
    for rank in range(world_size):
        start, count = chunk_rows(num_rows, world_size, rank)
        want = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, start + count)) == want


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("ndim", [2, 1])
def test_fused_qkv_rows_split_like_torchtitan(world_size, ndim):
    """Each rank's rows of the fused wqkv, split locally, put back together exactly into the wq/wk/wv
    that TorchTitan's own state-dict hook makes from the whole tensor, for any split of the rows."""
    from types import SimpleNamespace

    from torchtitan.models.common.attention import FusedQKVLinear

    heads_per_kv, head_dim, num_kv = 3, 4, 2
    rows = num_kv * (heads_per_kv + 2) * head_dim
    wqkv = torch.randn((rows, 6) if ndim == 2 else (rows,))
    param = "weight" if ndim == 2 else "bias"
    want = {f"wqkv.{param}": wqkv.clone()}
    module = SimpleNamespace(head_dim=head_dim, heads_per_kv=heads_per_kv, r_dim=heads_per_kv + 2)
    FusedQKVLinear._split_qkv_on_save(module, want, "", None)
    got: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        start, count = chunk_rows(rows, world_size, rank)
        split = split_fused_qkv(wqkv[start:start + count] if count else None, start, tuple(wqkv.shape),
                                heads_per_kv, head_dim)
        for target, (shape, pieces) in split.items():
            whole = got.setdefault(f"{target}.{param}", torch.full(shape, float("nan")))
            for first_row, piece in pieces:
                whole[first_row:first_row + piece.shape[0]] = piece
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("dtype", ["", "bfloat16"])
def test_shards_of_three_senders_assemble_bitwise(dtype):
    """Uneven and empty shards from 3 senders: every sender plans the same groups without talking to
    the others, and reading group by group gives back every whole tensor (converted like .to())."""
    sd = state_dict()
    sd["tiny.weight"] = torch.randn(2, 5)  # rank 2 holds none of it
    sd["odd.weight"] = torch.randn(7, 33)
    per_rank = [packed(chunk_pieces(sd, r, 3), MiB, dtype) for r in range(3)]
    groups = plan_groups(chunk_pieces(sd, 0, 3), MiB, dtype)
    for buckets in per_rank:  # a bucket's index is its group, whatever the sender
        assert all(groups[t.name] == b.index for b, _ in buckets for t in b.tensors)
    assert not any(t.name == "tiny.weight" for b, _ in per_rank[2] for t in b.tensors)
    got = {name: t.clone() for name, t in assemble(in_group_order(per_rank), "test")}
    want = {k: v.to(getattr(torch, dtype)) if dtype and v.is_floating_point() else v for k, v in sd.items()}
    assert_bitwise(got, want)


def test_a_receiver_holds_about_one_bucket_of_whole_tensors():
    """A whole tensor is handed on as soon as its group's last piece is read, never later."""
    sd = state_dict()
    per_rank = [packed(chunk_pieces(sd, r, 2), MiB) for r in range(2)]
    stream = in_group_order(per_rank)
    groups_read = []

    def reading():
        for bucket, buffer in stream:
            groups_read.append(bucket.index)
            yield bucket, buffer

    for name, _ in assemble(reading(), "test"):
        # 4 matrices of 256 KiB per 1 MiB group: a tensor of group g is out before group g + 1 is read.
        assert max(groups_read) == plan_groups(chunk_pieces(sd, 0, 2), MiB)[name]


def test_a_missing_piece_is_an_error_naming_the_tensor():
    sd = state_dict()
    per_rank = [packed(chunk_pieces(sd, r, 2), MiB) for r in range(2)]
    stream = in_group_order(per_rank)
    dropped = [(b, buf) for b, buf in stream if not (b.index == 1 and b.tensors[0].row_offset > 0)]
    with pytest.raises(ValueError, match=r"version 7: 4 tensors are missing rows, e\.g\. layers\.4\.weight"):
        list(assemble(dropped, "version 7"))
    twice = [stream[1]] + stream[1:]  # rank 1's rows of group 0 twice, rank 0's never: as many rows as needed
    with pytest.raises(ValueError, match="overlap or leave a gap"):
        list(assemble(twice, "version 7"))


# -- through Ray ---------------------------------------------------------------------------------
def _actor_classes():
    import ray

    class Peer:
        """Keeps one store client per spec, as the trainer and the engines do (a transport's
        buffers are allocated once and reused from version to version)."""

        def store(self, spec: StoreSpec) -> WeightStore:
            stores = self.__dict__.setdefault("stores", {})
            return stores.setdefault(spec, WeightStore(spec))

    @ray.remote(num_cpus=0)
    class Sender(Peer):
        def put(self, spec: StoreSpec, version: int, seed: int) -> int:
            return self.store(spec).put_state_dict(version, state_dict(seed)).nbytes

        def put_shard(self, spec: StoreSpec, version: int, seed: int, rank: int, world_size: int) -> int:
            """Put rank ``rank``'s torch.chunk rows of the test state dict, as an FSDP2 rank would."""
            pieces = chunk_pieces(state_dict(seed), rank, world_size)
            return self.store(spec).put_shards(version, pieces, rank=rank, num_ranks=world_size).nbytes

        def nixl_arenas(self, spec: StoreSpec, grace_s: float, release_s: float) -> int:
            """How many arenas this process sends the store's versions from; sets how long it waits
            for held ones (the module's constants, shortened so a test need not wait 30 s)."""
            from ray_forge.weights import nixl

            nixl.REF_GRACE_S, nixl.REF_RELEASE_S = grace_s, release_s
            return len(nixl._SENDING.get(spec.name, []))

    @ray.remote(num_cpus=0)
    class Receiver(Peer):
        def hold(self, spec: StoreSpec, version: int) -> None:
            """Keep the version's manifest, and so its refs, as a receiver that died holding them does."""
            self.__dict__.setdefault("held", []).append(self.store(spec).manifest(version))

        def drop_held(self) -> None:
            self.held = []

        def get(self, spec: StoreSpec, version: int, dtype: str = "") -> dict[str, torch.Tensor]:
            convert = getattr(torch, dtype) if dtype else None
            into = {k: torch.full_like(v, 7, dtype=convert if convert and v.is_floating_point() else v.dtype)
                    for k, v in state_dict().items()}
            return self.store(spec).get_state_dict(version, into=into)

        def slow_read(self, spec: StoreSpec, version: int, marker: str, pause_s: float) -> int:
            """Read the first bucket, say so, wait (the test kills the sender then), read the rest."""
            names = []
            for name, _ in self.store(spec).iter_state_dict(version):
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
@pytest.mark.parametrize("transport", ["shm", "object_store", "nixl"])
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
        if transport == "nixl":  # which UCX transport read the bytes here: it is logged once per process
            from ray_forge.weights.nixl import ucx_transports

            assert ucx_transports() and all(re.fullmatch(r"\S+/\S+ \((intra|inter)-node\)", t)
                                            for t in ucx_transports())
    finally:
        store.destroy()


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["shm", "object_store", "nixl"])
def test_a_sharded_version_is_published_once_every_rank_put_its_part(ray_cluster, peers, transport):
    """Two senders put their own rows (half the bytes each); until the second has, a receiver's wait
    fails naming it; then receivers read whole tensors, bitwise. Eviction frees both ranks' parts."""
    Sender, sender, receivers = peers
    other = Sender.remote()  # rank 1
    store = WeightStore.create(spec_for(transport, keep_versions=1, timeout_s=3, senders=("trainer-0", "trainer-1")))
    try:
        half = ray_cluster.get(sender.put_shard.remote(store.spec, 1, 1, 0, 2), timeout=60)
        assert half < 0.6 * sum(t.numel() * t.element_size() for t in state_dict().values())
        with pytest.raises(WeightSyncError, match="version 1 .*: trainer-1 did not put its part within 3s"):
            store.get_state_dict(1)
        ray_cluster.get(other.put_shard.remote(store.spec, 1, 1, 1, 2), timeout=60)
        for got in ray_cluster.get([r.get.remote(store.spec, 1) for r in receivers], timeout=60):
            assert_bitwise(got, state_dict(1))
        assert [p.rank for p in store.manifest(1).parts] == [0, 1]
        for rank, actor in enumerate((sender, other)):
            ray_cluster.get(actor.put_shard.remote(store.spec, 2, 2, rank, 2), timeout=60)
        # Each rank frees its own evicted part at its next put (rank 1 completed version 2: at once).
        ray_cluster.get(sender.put_shard.remote(store.spec, 3, 3, 0, 2), timeout=60)
        assert store.versions() == [2]
        if transport == "shm":
            assert sorted(p.name for p in store.transport.root.iterdir()) == [
                "policy_ver_0000000002", "policy_ver_0000000002-rank1", "policy_ver_0000000003"]
        assert_bitwise(store.get_state_dict(2), state_dict(2))
    finally:
        ray_cluster.kill(other)
        store.destroy()


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["shm", "object_store", "nixl"])
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
@pytest.mark.parametrize("transport", ["shm", "object_store", "nixl"])
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
@pytest.mark.parametrize("transport", ["shm", "object_store", "nixl"])
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
@pytest.mark.parametrize("transport", ["shm", "object_store", "nixl"])
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
        _wait_until_dead(ray_cluster, sender)  # ray.kill returns before the process is gone (late on a busy machine)
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            ray_cluster.get(pending, timeout=60)
        assert time.monotonic() - start < store.spec.timeout_s
        assert "WeightSyncError" in str(info.value) and "trainer-0" in str(info.value)
        assert "version 1" in str(info.value)
    finally:
        store.destroy()


@pytest.mark.ray
def test_nixl_reuses_its_buffers_once_every_ref_to_them_is_gone(ray_cluster, peers):
    """keep_versions=1: the sender writes into a set of buffers again three versions later, after
    the controller evicted the refs and the receivers dropped theirs; every version reads back
    bitwise, and no receiver's read sees a later version's bytes."""
    _, sender, receivers = peers
    store = WeightStore.create(spec_for("nixl", keep_versions=1, timeout_s=20))
    try:
        for version in range(1, 6):
            ray_cluster.get(sender.put.remote(store.spec, version, seed=version), timeout=60)
            for got in ray_cluster.get([r.get.remote(store.spec, version) for r in receivers], timeout=60):
                assert_bitwise(got, state_dict(version))
        assert store.versions() == [5]
    finally:
        store.destroy()


@pytest.mark.ray
def test_a_nixl_sender_writes_into_a_spare_arena_while_a_receiver_holds_old_refs(ray_cluster, peers):
    """keep_versions=1: two arenas, and two spares. A receiver holds the refs of versions 1-4 (as
    one that died holding them does until Ray notices): versions 3 and 4 go into spares after the
    grace wait, version 5 fails naming every held version; once the refs are dropped, version 6
    goes into one of the four arenas again, and every version written reads back bitwise."""
    _, sender, (holder, reader) = peers
    store = WeightStore.create(spec_for("nixl", keep_versions=1, timeout_s=3))
    arenas = [ray_cluster.get(sender.nixl_arenas.remote(store.spec, 1.0, 3.0), timeout=60)]
    try:
        for version in (1, 2, 3, 4):
            ray_cluster.get(sender.put.remote(store.spec, version, seed=version), timeout=60)
            ray_cluster.get(holder.hold.remote(store.spec, version), timeout=60)
            assert_bitwise(ray_cluster.get(reader.get.remote(store.spec, version), timeout=60), state_dict(version))
            arenas.append(ray_cluster.get(sender.nixl_arenas.remote(store.spec, 1.0, 3.0), timeout=60))
        assert arenas == [0, 1, 2, 3, 4]
        with pytest.raises(ray_cluster.exceptions.RayTaskError,
                           match=r"version 5: the buffers of versions \[1, 2, 3, 4\] are all still referenced"):
            ray_cluster.get(sender.put.remote(store.spec, 5, seed=5), timeout=60)
        ray_cluster.get(holder.drop_held.remote(), timeout=60)
        ray_cluster.get(sender.nixl_arenas.remote(store.spec, 1.0, 60.0), timeout=60)
        ray_cluster.get(sender.put.remote(store.spec, 6, seed=6), timeout=120)
        assert_bitwise(ray_cluster.get(reader.get.remote(store.spec, 6), timeout=60), state_dict(6))
        assert ray_cluster.get(sender.nixl_arenas.remote(store.spec, 5.0, 30.0), timeout=60) == 4
    finally:
        ray_cluster.get(holder.drop_held.remote(), timeout=60)
        store.destroy()


def _wait_until_dead(ray, actor, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the killed actor still answered after {timeout_s:.0f}s")


@pytest.mark.ray
def test_a_dead_nixl_sender_is_named_within_the_timeout(ray_cluster, peers):
    """Over NIXL the bytes stay in the sender's memory: once it is gone, a receiver's read fails
    at once, naming the sender and the version (Ray reports the refs' owner died)."""
    Sender, _, (receiver, _) = peers
    store = WeightStore.create(spec_for("nixl", timeout_s=20))
    sender = Sender.remote()  # its own: this one gets killed
    try:
        ray_cluster.get(sender.put.remote(store.spec, 1, seed=1), timeout=60)
        ray_cluster.kill(sender)
        _wait_until_dead(ray_cluster, sender)  # ray.kill returns before the process is gone (late on a busy machine)
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            ray_cluster.get(receiver.get.remote(store.spec, 1), timeout=60)
        assert time.monotonic() - start < store.spec.timeout_s
        assert "WeightSyncError" in str(info.value) and "version 1 from trainer-0" in str(info.value)
        assert "died" in str(info.value)
    finally:
        store.destroy()


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["shm", "object_store", "nixl"])
def test_a_version_that_never_comes_times_out_naming_the_sender(ray_cluster, transport):
    store = WeightStore.create(spec_for(transport, timeout_s=2))
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="version 9 from trainer-0 .*did not publish it within 2s"):
            store.get_state_dict(9)
        assert time.monotonic() - start < 10
    finally:
        store.destroy()


# -- a real 2-rank FSDP2 trainer and a real vLLM engine ------------------------------------------
@pytest.fixture(scope="module")
def tied_unaligned_model_dir(tmp_path_factory) -> str:
    """Tied embeddings (the adapter drops lm_head.weight) and 3 kv heads of 3 q heads: the fused
    wqkv has 288 rows, so rank 0's 144 end inside a k head, and the embedding's rows split unevenly."""
    from envs.blackjack import BlackjackTextEnv
    from ray_forge.config.schema import TinyModelConfig
    from ray_forge.models.tiny import make_tiny_qwen3

    folder = tmp_path_factory.mktemp("models") / "tied_unaligned"
    shape = TinyModelConfig(hidden_size=96, intermediate_size=160, num_layers=2, num_heads=3, num_kv_heads=3,
                            head_dim=32, tie_word_embeddings=True)
    return str(make_tiny_qwen3(folder, BlackjackTextEnv.corpus(), shape))


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_two_fsdp_ranks_put_their_own_shards_and_vllm_loads_the_whole_model(ray_cluster, tied_unaligned_model_dir,
                                                                             tmp_path, transport):
    """Each of 2 FSDP2 ranks puts only its own rows (about half the bytes each; no gather); a
    receiver's assembled version equals full_hf_state_dict of the same model bit for bit, and a
    vLLM engine that loads it computes what the trainer computes."""
    import asyncio

    from safetensors.torch import load_file

    from envs.blackjack import ACTION_WORDS, BlackjackTextEnv
    from ray_forge.actors.policy import VLLMPolicy
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.core.episode import Sample

    model_dir = tied_unaligned_model_dir
    engine = VLLMPolicy(tiny_configs.policy(kv_cache_mb=64), model_dir=model_dir, action_words=ACTION_WORDS)
    ranks = [TrainerActor.options(num_cpus=0.5).remote(
        tiny_configs.trainer(lr=3e-3, num_ranks=2), model_dir=model_dir, grpo=tiny_configs.grpo(), total_steps=5, rank=r,
            allowed_token_ids=engine.allowed_ids) for r in range(2)]
    trainer = TrainerGroup(ranks, timeout_s=300)
    store = WeightStore.create(StoreSpec(name=f"test-{uuid.uuid4().hex[:8]}", transport=transport, bucket_bytes=2**16,
                                         senders=("trainer-0", "trainer-1")))
    try:
        trainer.setup()
        prompts = [BlackjackTextEnv().reset(seed) for seed in range(360)]
        before = [c.text for c in engine.generate(prompts, greedy=True)]
        hit = engine.tokenizer.convert_tokens_to_ids("HIT")
        samples = [Sample.completion(c.prompt_ids, (hit,), behaviour_logprobs=(-0.7,),
                          advantage=1.0, policy_version=0) for c in engine.generate(prompts)]
        for _ in range(2):
            asyncio.run(trainer.train_step(samples))
        asyncio.run(trainer.publish_weights(store.spec, 2))

        manifest = store.manifest(2)
        assert [p.sender for p in manifest.parts] == ["trainer-0", "trainer-1"]
        assert len({b.index for b in manifest.buckets}) > 2  # several groups
        assert all(p.nbytes < 0.6 * manifest.nbytes for p in manifest.parts)  # each rank put about half
        k_proj = {p.rank for p in manifest.parts for b in p.buckets for t in b.tensors
                  if t.name == "model.layers.0.self_attn.k_proj.weight"}
        assert k_proj == {0, 1}  # the ranks' halves of the fused wqkv meet inside a k head
        got = store.get_state_dict(2)
        asyncio.run(trainer.export_hf(str(tmp_path / "full")))  # full_hf_state_dict, gathered
        want = load_file(str(tmp_path / "full" / "model.safetensors"))
        assert "lm_head.weight" not in got
        assert_bitwise(got, want)

        engine.update_weights(store.spec, 2)
        after = engine.generate(prompts, greedy=True)
        assert [c.text for c in after] != before  # the engine now runs the trained weights
        rows = ray_cluster.get([r.logits.remote([list(c.prompt_ids) for c in after]) for r in ranks], timeout=300)[0]
        for c, row in zip(after, rows):
            assert c.response_ids[0] == max(engine.allowed_ids, key=lambda t: row[-1, t].item())
        sampled = engine.generate(prompts[:32])
        rows = ray_cluster.get([r.logits.remote([list(c.prompt_ids) for c in sampled]) for r in ranks],
                               timeout=300)[0]
        for c, row in zip(sampled, rows):
            expected = torch.log_softmax(row[-1, engine.allowed_ids], -1)[engine.allowed_ids.index(c.response_ids[0])]
            assert c.logprobs[0] == pytest.approx(expected.item(), abs=1e-4)
    finally:
        trainer.shutdown()
        for r in ranks:
            ray_cluster.kill(r)
        store.destroy()
        engine.shutdown()


def test_the_controller_frees_a_version_for_rewriting_once_no_reader_will_read_it():
    """A sender may write into a version's buffers again once it is evicted and every engine handed
    it said it holds its own copy or was found dead; a manifest handed to no named reader leaves
    the answer to Ray's count of refs."""
    import asyncio

    from ray_forge.weights.base import Part
    from ray_forge.weights.controller import WeightStoreController

    async def scenario() -> list:
        controller = WeightStoreController()
        answers = []
        for version in (1, 2, 3):
            await controller.put_part(Part(version, "trainer-0", "nixl", (), None), 1, keep_versions=1)
            if version == 1:
                await controller.manifest(1, 1.0, ("policy-0", 10))
                await controller.manifest(1, 1.0, ("policy-1", 20))
                await controller.read_done(1, ("policy-0", 10))
                answers.append(await controller.reclaimable([1]))  # live, and policy-1 reads it
            if version == 2:
                await controller.manifest(2, 1.0)  # a reader without a name
                answers.append(await controller.reclaimable([1, 2]))  # 1 evicted, but policy-1 still reads it
        await controller.receiver_gone("policy-1", 20)
        answers.append(await controller.reclaimable([1, 2, 3]))  # 3 is live; 2 went to an unnamed reader
        return answers

    assert asyncio.run(scenario()) == [{}, {}, {1: [("policy-1", 20)]}]
