"""Weight syncs between real TorchTitan ranks and real vLLM engines, the same for every transport:
2 ranks (gloo) each put their own shards, 2 engines take the version, driven as the job drives them
(``TrainerGroup.publish_weights`` and ``Fleet.sync`` together). Over ``collective`` the ranks
broadcast straight into the engines; over ``nixl`` the engines read the ranks' registered buffers
with Ray Direct Transport. Exact transfers; a stuck, a killed and a restarted engine; a trainer
rank lost mid-sync; and, at the transport level, a peer killed mid-transfer."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ray_forge import identity
from ray_forge.weights import StoreSpec, WeightStore
from ray_forge.weights.layout import tensors_digest
import tiny_configs

pytestmark = pytest.mark.ray

TIMEOUT_S = 15.0
TRANSPORTS = ["collective", "nixl"]


@dataclass
class Setup:
    spec: StoreSpec
    store: WeightStore
    policies: list
    ranks: list
    trainer: object
    fleet: object
    prompts: list[str]
    samples: list

    @property
    def pushes(self) -> bool:
        """The transport streams into live engines: nothing is stored for a late one."""
        return self.spec.transport == "collective"


@pytest.fixture(scope="module", params=TRANSPORTS)
def setup(request, ray_cluster, tiny_model_dir):
    from envs.blackjack import ACTION_WORDS, BlackjackTextEnv
    from ray_forge.actors.policy import PolicyActor
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.core.episode import Sample
    from ray_forge.run.fleet import Fleet

    transport = request.param
    tag = uuid.uuid4().hex[:6]
    names = tuple(f"{transport}-{tag}-policy-{i}" for i in range(2))
    spec = StoreSpec(name=f"{transport}-{tag}", transport=transport, senders=("trainer-0", "trainer-1"),
                     receivers=names, timeout_s=TIMEOUT_S, bucket_bytes=2**16)  # several buckets per rank
    store = WeightStore.create(spec)
    policies = [PolicyActor.options(name=name, num_cpus=0.25, max_restarts=1).remote(
        tiny_configs.policy(kv_cache_mb=64), model_dir=tiny_model_dir, action_words=ACTION_WORDS, seed=i,
            store_name=spec.name) for i, name in enumerate(names)]
    allowed = ray_cluster.get(policies[0].get_allowed_token_ids.remote(), timeout=300)
    ranks = [TrainerActor.options(num_cpus=0.25).remote(
        tiny_configs.trainer(lr=3e-3, num_ranks=2), model_dir=tiny_model_dir, grpo=tiny_configs.grpo(), total_steps=20, rank=r,
            allowed_token_ids=allowed) for r in range(2)]
    trainer = TrainerGroup(ranks, timeout_s=300)
    trainer.setup()
    prompts = [BlackjackTextEnv().reset(seed) for seed in range(360)]
    hit = allowed[0]
    turns = ray_cluster.get(policies[0].generate.remote(prompts[:64]), timeout=300)
    samples = [Sample.completion(t.prompt_ids, (hit,), behaviour_logprobs=(-0.7,),
                      advantage=1.0, policy_version=0) for t in turns]
    fleet = Fleet(policies, [], policy_timeout_s=60, env_timeout_s=30)
    yield Setup(spec, store, policies, ranks, trainer, fleet, prompts, samples)
    trainer.shutdown()
    for actor in [*policies, *ranks]:
        ray_cluster.kill(actor)
    store.destroy()


async def _train_and_sync(s: Setup, version: int) -> tuple[float, dict]:
    """One step, then the trainer's publish and the fleet's sync at the same time (the job's sync_weights)."""
    await s.trainer.train_step(s.samples)
    return tuple(await asyncio.gather(s.trainer.publish_weights(s.spec, version), s.fleet.sync(s.spec, version)))


async def _publish_on_every_rank(s: Setup, version: int) -> list:
    """Each rank's publish_weights, its error included (TrainerGroup would only log a failed sync)."""
    from ray_forge.remote import call

    refs = [r.publish_weights.remote(s.spec, version) for r in s.ranks]
    return await asyncio.gather(*(call(ref, timeout_s=120, what="publish_weights", actor=identity.trainer(i))
                                  for i, ref in enumerate(refs)), return_exceptions=True)


def _trainer_digest(s: Setup, tmp_path) -> str:
    """Digest of full_hf_state_dict of the trainer, gathered and written by export_hf."""
    from safetensors.torch import load_file

    folder = tmp_path / f"export-{uuid.uuid4().hex[:6]}"
    asyncio.run(s.trainer.export_hf(str(folder)))
    return tensors_digest(load_file(str(folder / "model.safetensors")).items())


def _digests(ray_cluster, policies) -> list:
    return ray_cluster.get([p.weight_transfer_rpc.remote("weights_digest") for p in policies], timeout=60)


def _greedy(ray_cluster, policy, prompts) -> list:
    return ray_cluster.get(policy.generate.remote(prompts, greedy=True), timeout=300)


def _versions(ray_cluster, s: Setup) -> list[int]:
    return ray_cluster.get([p.get_version.remote() for p in s.policies], timeout=60)


def _assert_engine_computes_like_the_trainer(ray_cluster, s: Setup, policy) -> None:
    allowed = ray_cluster.get(policy.get_allowed_token_ids.remote(), timeout=60)
    greedy = _greedy(ray_cluster, policy, s.prompts)
    rows = ray_cluster.get([r.logits.remote([list(t.prompt_ids) for t in greedy]) for r in s.ranks], timeout=300)[0]
    for turn, row in zip(greedy, rows):
        assert turn.response_ids[0] == max(allowed, key=lambda t: row[-1, t].item())
    sampled = ray_cluster.get(policy.generate.remote(s.prompts[:32]), timeout=300)
    rows = ray_cluster.get([r.logits.remote([list(t.prompt_ids) for t in sampled]) for r in s.ranks], timeout=300)[0]
    for turn, row in zip(sampled, rows):
        expected = torch.log_softmax(row[-1, allowed], -1)[allowed.index(turn.response_ids[0])]
        assert turn.logprobs[0] == pytest.approx(expected.item(), abs=1e-4)


@pytest.mark.vllm
def test_a_sync_reaches_every_engine_bitwise(ray_cluster, setup, tmp_path):
    s = setup
    before = [t.text for t in _greedy(ray_cluster, s.policies[0], s.prompts)]
    for version in (1, 2):
        publish_s, engines = asyncio.run(_train_and_sync(s, version))
        assert publish_s > 0 and engines["load_s"] > 0 and engines["paused_s"] >= engines["load_s"]
        assert _versions(ray_cluster, s) == [version, version]
        want = _trainer_digest(s, tmp_path)
        assert _digests(ray_cluster, s.policies) == [[want], [want]]  # every engine got exactly the trainer's bytes
        for policy in s.policies:
            _assert_engine_computes_like_the_trainer(ray_cluster, s, policy)
    assert [t.text for t in _greedy(ray_cluster, s.policies[0], s.prompts)] != before  # it trained
    assert s.fleet.serving == 2
    routes = ray_cluster.get([p.weights_route.remote() for p in s.policies], timeout=60)
    if s.pushes:
        assert routes == ["collective (gloo broadcast)"] * 2
    else:  # which UCX transport carried the bytes into each engine: here, on one machine, cross-memory attach
        assert all(re.fullmatch(r"nixl \(UCX: \S+/\S+ \((intra|inter)-node\)\)", r) for r in routes), routes
    if s.pushes:
        sessions = [ray_cluster.get(s.store.controller.push_session.remote(v, 1), timeout=60) for v in (1, 2)]
        assert sessions[0].generation == sessions[1].generation  # the second push reused the groups


@pytest.mark.vllm
def test_an_engine_that_never_asks(ray_cluster, setup, tmp_path):
    """policy-1 is in the sync but never asks for the version (stuck). Over a push, each trainer
    rank names it once the timeout is up, and policy-0, which received nothing, names the sender
    rank it waited for and keeps serving its version, unchanged. Over a stored version it holds up
    no one: the ranks publish and policy-0 loads the version at once."""
    from ray_forge.weights.sync import SyncRound

    s = setup
    survivor = s.policies[0]
    version = ray_cluster.get(survivor.get_version.remote(), timeout=60)
    before = [t.text for t in _greedy(ray_cluster, survivor, s.prompts)]

    async def sync_to_one():
        await s.trainer.train_step(s.samples)
        round_ = await SyncRound.open(s.spec, version + 1, [0, 1])
        results = await asyncio.gather(_publish_on_every_rank(s, version + 1),
                                       asyncio.wrap_future(survivor.update_weights.remote(s.spec, version + 1)
                                                           .future()), return_exceptions=True)
        await round_.close()
        return results

    start = time.monotonic()
    trainer_results, survivor_result = asyncio.run(sync_to_one())
    elapsed = time.monotonic() - start
    if not s.pushes:
        assert elapsed < TIMEOUT_S and all(isinstance(r, float) for r in trainer_results)
        assert survivor_result["version"] == version + 1 == ray_cluster.get(survivor.get_version.remote(), timeout=60)
        assert _digests(ray_cluster, [survivor]) == [[_trainer_digest(s, tmp_path)]]
        return
    assert TIMEOUT_S - 1 < elapsed < TIMEOUT_S + 10
    for error in trainer_results:
        assert "WeightSyncError" in str(error) and "receivers not ready" in str(error)
        assert s.spec.receivers[1] in str(error).split("not ready")[1] and s.spec.receivers[0] not in str(error)
    assert "WeightSyncError" in str(survivor_result)
    assert "from trainer-0 (trainer rank 0)" in str(survivor_result)
    assert ray_cluster.get(survivor.get_version.remote(), timeout=60) == version
    assert [t.text for t in _greedy(ray_cluster, survivor, s.prompts)] == before


@pytest.mark.vllm
def test_a_killed_engine_is_named_and_the_others_go_on(ray_cluster, setup, tmp_path, caplog):
    """policy-1 is killed before a sync the fleet does not know about. The fleet names it within
    the timeout. Over a push the push fails at once, naming it, on every trainer rank and on
    policy-0, which keeps its version; the next push rebuilds the groups without policy-1 (Ray is
    restarting it) and reaches policy-0. Over a stored version policy-0 takes the version as if
    nothing happened."""
    s = setup
    survivor, victim = s.policies
    version = ray_cluster.get(survivor.get_version.remote(), timeout=60)
    before = [t.text for t in _greedy(ray_cluster, survivor, s.prompts)]
    serving = s.fleet.serving
    ray_cluster.kill(victim, no_restart=False)

    async def scenario():
        await s.trainer.train_step(s.samples)
        start = time.monotonic()
        results, loaded = await asyncio.gather(_publish_on_every_rank(s, 10), s.fleet.sync(s.spec, 10))
        synced_in = time.monotonic() - start
        kept = await asyncio.wrap_future(survivor.get_version.remote().future())
        kept_texts = [t.text for t in await asyncio.wrap_future(survivor.generate.remote(s.prompts, greedy=True)
                                                                 .future())]
        assert s.fleet.down(identity.policy(1))  # the fleet knows: the next sync leaves it out
        await _train_and_sync(s, 11)
        return results, loaded, synced_in, kept, kept_texts

    with caplog.at_level(logging.WARNING, logger="ray_forge.run.fleet"):
        results, loaded, synced_in, kept, kept_texts = asyncio.run(scenario())
    assert synced_in < TIMEOUT_S
    assert any("policy-1.update_weights failed: the actor died" in r.getMessage() for r in caplog.records)
    if s.pushes:
        for error in results:
            assert "WeightSyncError" in str(error) and "policy-1 died" in str(error)
        assert loaded == {} and kept == version and kept_texts == before  # policy-0 did not get version 10
        sessions = [ray_cluster.get(s.store.controller.push_session.remote(v, 1), timeout=60) for v in (10, 11)]
        assert sessions[0].receivers == s.spec.receivers
        assert sessions[1].generation > sessions[0].generation and sessions[1].receivers == (s.spec.receivers[0],)
    else:
        assert all(isinstance(r, float) for r in results) and loaded["load_s"] > 0 and kept == 10
    assert ray_cluster.get(survivor.get_version.remote(), timeout=60) == 11
    assert s.fleet.serving == 11 and serving < 11
    assert _digests(ray_cluster, [survivor]) == [[_trainer_digest(s, tmp_path)]]
    _assert_engine_computes_like_the_trainer(ray_cluster, s, survivor)


@pytest.mark.vllm
def test_a_restarted_engine_catches_up(ray_cluster, setup, tmp_path):
    """Ray restarted policy-1 (killed above). Over a stored version it loads the newest one before
    it serves; over a push nothing is stored to catch up from, so it serves the base model, told
    the controller, and the next push rebuilds the groups with it. Either way the next sync
    reaches both engines exactly."""
    s = setup
    restarted = s.policies[1]
    deadline = time.monotonic() + 120
    while True:  # wait for Ray to bring it back
        try:
            _, version = ray_cluster.get(restarted.whoami.remote(), timeout=60)
            break
        except ray_cluster.exceptions.RayActorError:
            assert time.monotonic() < deadline, "policy-1 did not come back"
            time.sleep(1)
    want = _trainer_digest(s, tmp_path)
    if s.pushes:
        assert version == 0  # the base model until a push includes it
        before = ray_cluster.get(s.store.controller.push_session.remote(11, 1), timeout=60)
    else:
        assert version == 11 and _digests(ray_cluster, [restarted]) == [[want]]
        _assert_engine_computes_like_the_trainer(ray_cluster, s, restarted)
    asyncio.run(_train_and_sync(s, 12))
    if s.pushes:
        after = ray_cluster.get(s.store.controller.push_session.remote(12, 1), timeout=60)
        assert after.generation > before.generation and after.receivers == s.spec.receivers
    assert _versions(ray_cluster, s) == [12, 12]
    assert _digests(ray_cluster, s.policies) == [[_trainer_digest(s, tmp_path)]] * 2
    _assert_engine_computes_like_the_trainer(ray_cluster, s, restarted)


@pytest.mark.vllm
def test_a_lost_trainer_rank_is_named_and_every_engine_keeps_its_version(ray_cluster, setup, caplog):
    """trainer-1 dies before it puts its part of a version (the module's last test: the trainer is
    gone after it). Every engine's sync fails within the timeout naming trainer-1, and every
    engine keeps serving the version it had; the trainer group raises the death (a job stops
    with its resume command)."""
    from ray_forge.remote import RemoteCallError

    s = setup
    versions = _versions(ray_cluster, s)
    texts = [t.text for t in _greedy(ray_cluster, s.policies[0], s.prompts)]
    ray_cluster.kill(s.ranks[1])

    async def scenario():
        start = time.monotonic()
        published, synced = await asyncio.gather(s.trainer.publish_weights(s.spec, 13), s.fleet.sync(s.spec, 13),
                                                 return_exceptions=True)
        return published, synced, time.monotonic() - start

    with caplog.at_level(logging.WARNING, logger="ray_forge.run.fleet"):
        published, synced, elapsed = asyncio.run(scenario())
    assert isinstance(published, RemoteCallError) and published.died and published.actor == identity.trainer(1)
    assert synced == {} and s.fleet.failed_syncs == 1 and s.fleet.serving == 12
    assert elapsed < TIMEOUT_S + 15
    named = [r.getMessage() for r in caplog.records if "trainer-1 did not put its part within 15s" in r.getMessage()]
    assert len(named) == 2  # each engine's failed sync says who did not deliver
    assert _versions(ray_cluster, s) == versions
    assert [t.text for t in _greedy(ray_cluster, s.policies[0], s.prompts)] == texts


# -- a peer killed mid-transfer, at the transport level (no vLLM: the engine's receive path alone) ------
def _transport_actors():
    import ray

    from ray_forge.weights.layout import Piece
    from ray_forge.weights.shards import chunk_rows

    def big_state() -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return {f"layers.{i}.weight": torch.randn(512, 128, generator=gen) for i in range(400)}  # 100 MB

    @ray.remote(num_cpus=0)
    class Sender:
        """A trainer rank: its torch.chunk rows of every tensor."""

        def __init__(self, rank: int) -> None:
            self.rank, self.store = rank, None
            self.pieces = []
            for name, t in big_state().items():
                start, count = chunk_rows(t.shape[0], 2, rank)
                self.pieces.append(Piece(name, tuple(t.shape), t.dtype, start, t[start:start + count].clone()))

        def push(self, spec: StoreSpec, version: int) -> int:
            self.store = self.store if self.store and self.store.spec == spec else WeightStore(spec)  # keeps its groups
            return self.store.put_shards(version, self.pieces, rank=self.rank, num_ranks=2).nbytes

    @ray.remote(num_cpus=0)
    class Receiver:
        """An engine's receiving half: fetch, then the digest of what it would load."""

        def __init__(self) -> None:
            self.store = None

        def receive(self, spec: StoreSpec, version: int, name: str, marker: str = "", pause_s: float = 0.0) -> str:
            """``marker``: touch it once a NIXL fetch has read its first part (one sender rank's
            buckets) and pause ``pause_s`` after each, so that the test can kill a peer while the
            bytes flow."""
            self.store = self.store if self.store and self.store.spec == spec else WeightStore(spec)
            if marker:
                _slow_nixl_receive(self.store.transport, Path(marker), pause_s)
            manifest = self.store.fetch(version, member=name)
            return tensors_digest(self.store.iter_manifest(manifest))

    return Sender, Receiver, lambda: tensors_digest(big_state().items())


def _slow_nixl_receive(transport, marker: Path, pause_s: float) -> None:
    receive = type(transport)._receive

    def slowly(part, targets, deadline):
        receive(transport, part, targets, deadline)
        marker.touch()
        time.sleep(pause_s)

    transport._receive = slowly


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("victim", ["receiver", "sender"])
def test_a_peer_killed_mid_transfer_is_named(ray_cluster, tmp_path, transport, victim):
    """800 buckets from two ranks; one receiver (or one sender rank) is killed while the bytes
    flow. Over a push, the others fail within the timeout naming it: the senders list the
    receiver that did not acknowledge, a receiver the sender rank whose bucket it was waiting for;
    a push rebuilt without the dead receiver then delivers the next version exactly. Over NIXL a
    dead sender fails the receivers within the timeout naming it; a dead receiver stops no one:
    the other gets the version exactly, and the senders, whose buffers the dead one borrowed,
    publish the next versions into them without waiting out the timeout."""
    from ray_forge.weights.sync import SyncRound

    Sender, Receiver, digest = _transport_actors()
    tag = uuid.uuid4().hex[:6]
    names = (f"mid-{tag}-policy-0", f"mid-{tag}-policy-1")
    spec = StoreSpec(name=f"mid-{tag}", transport=transport, senders=("trainer-0", "trainer-1"), receivers=names,
                     timeout_s=TIMEOUT_S, bucket_bytes=2**16, keep_versions=1)
    store = WeightStore.create(spec)
    senders, receivers = [Sender.remote(r) for r in range(2)], [Receiver.remote() for _ in names]
    slow = {"marker": str(tmp_path / "flowing"), "pause_s": 1.0} if transport == "nixl" else {}
    try:
        async def transfer(version: int, to: list[int], kill=None) -> tuple[list, float]:
            round_ = await SyncRound.open(spec, version, to)
            calls = [s.push.remote(spec, version) for s in senders] + \
                    [receivers[i].receive.remote(spec, version, names[i], **(slow if kill else {})) for i in to]
            start = time.monotonic()
            if kill is not None:
                await _flowing(round_, version, len(to), tmp_path / "flowing")
                ray_cluster.kill(kill)
            results = await asyncio.gather(*(asyncio.wrap_future(c.future()) for c in calls), return_exceptions=True)
            await round_.close()
            return results, time.monotonic() - start

        results, _ = asyncio.run(transfer(1, [0, 1]))
        assert results[2:] == [digest(), digest()]  # exact, from two ranks' rows
        killed = receivers[1] if victim == "receiver" else senders[1]
        results, elapsed = asyncio.run(transfer(2, [0, 1], kill=killed))
        assert elapsed < TIMEOUT_S
        errors = [str(e) for e in results]
        if victim == "sender":
            for receiver_error in errors[2:]:
                assert "WeightSyncError" in receiver_error and "from trainer-1" in receiver_error
                assert "(trainer rank 1)" in receiver_error or "died" in receiver_error
            return  # a dead trainer rank ends a job: nothing to rebuild for
        if transport == "collective":
            for sender_error in errors[:2]:
                assert "WeightSyncError" in sender_error
                assert sender_error.rstrip().endswith(f"receivers that did not acknowledge: {names[1]}")
            assert "WeightSyncError" in errors[2] and f"{names[0]}: bucket" in errors[2]
            assert "(trainer rank " in errors[2]
        else:
            assert results[:2] == [r for r in results[:2] if isinstance(r, int)] and results[2] == digest()
            assert "RayActorError" in errors[3] or "died" in errors[3]
        for version in (3, 4, 5):  # over NIXL: every arena written again (keep_versions + 1 of them)
            # A put that waited out the timeout for refs the dead receiver held would raise, not count bytes.
            results, _ = asyncio.run(transfer(version, [0]))
            assert results[:2] == [r for r in results[:2] if isinstance(r, int)] and results[2] == digest()
    finally:
        for actor in [*senders, *receivers]:
            ray_cluster.kill(actor)
        store.destroy()


async def _flowing(round_, version: int, num_receivers: int, marker: Path) -> None:
    """Return once the bytes have started to flow: over a push every receiver said it is ready;
    over NIXL a receiver has read its first part."""
    from datetime import timedelta

    import torch.distributed as dist

    from ray_forge.weights import version_key

    deadline = time.monotonic() + 60
    if round_.session is None:
        while not marker.exists():
            assert time.monotonic() < deadline, "no receiver read a bucket"
            await asyncio.sleep(0.01)
        return
    session = round_.session
    client = dist.TCPStore(session.host, session.port, is_master=False, timeout=timedelta(seconds=30))
    keys = [session.key(version_key(version), "ready", r) for r in range(1, 1 + num_receivers)]
    while not client.check(keys):
        assert time.monotonic() < deadline, "the receivers never got ready"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)


def test_a_publish_that_no_driver_opened_says_how_to_run_it(ray_cluster):
    """Over a push transport the trainer's publish and the fleet's sync must run together; a driver
    that runs them one after the other gets this error, not a silent run with stale engines."""
    from ray_forge.weights import SyncNotOpened

    Sender, _, _ = _transport_actors()
    spec = StoreSpec(name=f"unopened-{uuid.uuid4().hex[:6]}", transport="collective",
                     senders=("trainer-0", "trainer-1"), receivers=("policy-0",), timeout_s=2)
    store = WeightStore.create(spec)
    sender = Sender.remote(0)
    try:
        start = time.monotonic()
        with pytest.raises(SyncNotOpened, match="no push of weights version 1 was opened within 2s.*Fleet.sync"):
            ray_cluster.get(sender.push.remote(spec, 1), timeout=60)
        assert time.monotonic() - start < 15
    finally:
        ray_cluster.kill(sender)
        store.destroy()
