"""The collective weight transport on CPU (gloo): 2 TorchTitan ranks push straight into 2 real vLLM
engines, each rank broadcasting its own shards. Exact transfers, a stuck and a killed engine named
within the timeout, the survivor left on its version, and the groups rebuilt afterwards."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import pytest
import torch

from ray_forge.weights import StoreSpec, WeightStore

pytestmark = pytest.mark.ray

TIMEOUT_S = 15.0


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


@pytest.fixture(scope="module")
def setup(ray_cluster, tiny_model_dir):
    from envs.blackjack import ACTION_WORDS, BlackjackTextEnv
    from ray_forge.actors.policy import PolicyActor
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.config.schema import GRPOConfig, PolicyConfig, TrainerConfig
    from ray_forge.core.episode import Sample
    from ray_forge.run.fleet import Fleet

    tag = uuid.uuid4().hex[:6]
    names = tuple(f"collective-{tag}-policy-{i}" for i in range(2))
    spec = StoreSpec(name=f"collective-{tag}", transport="collective", senders=("trainer-0", "trainer-1"),
                     receivers=names, timeout_s=TIMEOUT_S, bucket_bytes=2**16)  # several buckets per rank
    store = WeightStore.create(spec)
    policies = [PolicyActor.options(name=name, num_cpus=0.25, max_restarts=1).remote(
        PolicyConfig(kv_cache_mb=64), model_dir=tiny_model_dir, action_words=ACTION_WORDS, seed=i,
            store_name=spec.name) for i, name in enumerate(names)]
    allowed = ray_cluster.get(policies[0].get_allowed_token_ids.remote(), timeout=300)
    ranks = [TrainerActor.options(num_cpus=0.25).remote(
        TrainerConfig(lr=3e-3, num_ranks=2), model_dir=tiny_model_dir, grpo=GRPOConfig(), total_steps=10, rank=r,
            allowed_token_ids=allowed) for r in range(2)]
    trainer = TrainerGroup(ranks, timeout_s=300)
    trainer.setup()
    prompts = [BlackjackTextEnv().reset(seed) for seed in range(360)]
    hit = allowed[0]
    turns = ray_cluster.get(policies[0].generate.remote(prompts[:64]), timeout=300)
    samples = [Sample.completion(t.prompt_ids, (hit,), behaviour_logprobs=(-0.7,),
                      advantage=1.0, policy_version=0) for t in turns]
    fleet = Fleet(policies, [], policy_timeout_s=30, env_timeout_s=30)
    yield Setup(spec, store, policies, ranks, trainer, fleet, prompts, samples)
    trainer.shutdown()
    for actor in [*policies, *ranks]:
        ray_cluster.kill(actor)
    store.destroy()


async def _train_and_push(s: Setup, version: int) -> tuple[float, dict]:
    """One step, then the trainer's publish and the fleet's push at the same time (the job's push_weights)."""
    await s.trainer.train_step(s.samples)
    return tuple(await asyncio.gather(s.trainer.publish_weights(s.spec, version), s.fleet.push(s.spec, version)))


async def _publish_on_every_rank(s: Setup, version: int) -> list:
    """Each rank's publish_weights, its error included (TrainerGroup would only log a failed push)."""
    from ray_forge.remote import call

    refs = [r.publish_weights.remote(s.spec, version) for r in s.ranks]
    return await asyncio.gather(*(call(ref, timeout_s=120, what=f"trainer-{i}.publish_weights")
                                  for i, ref in enumerate(refs)), return_exceptions=True)


def _trainer_state(ray_cluster, s: Setup, tmp_path) -> dict[str, torch.Tensor]:
    """full_hf_state_dict of the trainer, gathered and written by export_hf."""
    from safetensors.torch import load_file

    folder = tmp_path / f"export-{uuid.uuid4().hex[:6]}"
    asyncio.run(s.trainer.export_hf(str(folder)))
    return load_file(str(folder / "model.safetensors"))


def _greedy(ray_cluster, policy, prompts) -> list:
    return ray_cluster.get(policy.generate.remote(prompts, greedy=True), timeout=300)


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
def test_a_push_reaches_every_engine_bitwise_and_keeps_its_groups(ray_cluster, setup, tmp_path):
    from ray_forge.weights.collective import tensors_digest

    s = setup
    before = [t.text for t in _greedy(ray_cluster, s.policies[0], s.prompts)]
    for version in (1, 2):
        publish_s, engines = asyncio.run(_train_and_push(s, version))
        assert publish_s > 0 and engines["load_s"] > 0 and engines["paused_s"] >= engines["load_s"]
        assert ray_cluster.get([p.get_version.remote() for p in s.policies], timeout=60) == [version, version]
        want = tensors_digest(_trainer_state(ray_cluster, s, tmp_path).items())
        digests = ray_cluster.get([p.weight_transfer_rpc.remote("weights_digest") for p in s.policies], timeout=60)
        assert digests == [[want], [want]]  # every engine received exactly the trainer's bytes
        for policy in s.policies:
            _assert_engine_computes_like_the_trainer(ray_cluster, s, policy)
    assert [t.text for t in _greedy(ray_cluster, s.policies[0], s.prompts)] != before  # it trained
    sessions = [ray_cluster.get(s.store.controller.push_session.remote(v, 1), timeout=60) for v in (1, 2)]
    assert sessions[0].generation == sessions[1].generation  # the second push reused the groups
    assert s.fleet.serving == 2


@pytest.mark.vllm
def test_an_engine_that_never_joins_is_named_at_the_timeout(ray_cluster, setup):
    """policy-1 is in the push but never asks for it (stuck): each trainer rank names it once the
    timeout is up; policy-0, which received nothing, names the sender rank it waited for and keeps
    serving its version, unchanged."""
    from ray_forge.weights.collective import close_push, open_push

    s = setup
    survivor = s.policies[0]
    version = ray_cluster.get(survivor.get_version.remote(), timeout=60)
    before = [t.text for t in _greedy(ray_cluster, survivor, s.prompts)]

    async def push_to_one():
        await s.trainer.train_step(s.samples)
        await open_push(s.spec, version + 1, s.spec.receivers)
        results = await asyncio.gather(_publish_on_every_rank(s, version + 1),
                                       asyncio.wrap_future(survivor.update_weights.remote(s.spec, version + 1)
                                                           .future()), return_exceptions=True)
        await close_push(s.spec, version + 1)
        return results

    start = time.monotonic()
    trainer_errors, survivor_error = asyncio.run(push_to_one())
    elapsed = time.monotonic() - start
    assert TIMEOUT_S - 1 < elapsed < TIMEOUT_S + 10
    for error in trainer_errors:
        assert "WeightSyncError" in str(error) and "receivers not ready" in str(error)
        assert s.spec.receivers[1] in str(error).split("not ready")[1] and s.spec.receivers[0] not in str(error)
    assert "WeightSyncError" in str(survivor_error)
    assert f"{s.spec.receivers[0]} keeps weights version {version}" in str(survivor_error)
    assert "from trainer-0 (trainer rank 0)" in str(survivor_error)
    assert ray_cluster.get(survivor.get_version.remote(), timeout=60) == version
    assert [t.text for t in _greedy(ray_cluster, survivor, s.prompts)] == before


@pytest.mark.vllm
def test_a_killed_engine_is_named_and_the_groups_are_rebuilt_without_it(ray_cluster, setup, tmp_path):
    """policy-1 is killed before a push the fleet does not know about: the push fails at once,
    naming it, on every trainer rank and on policy-0, which keeps its version. The next push
    rebuilds the groups without policy-1 (Ray is restarting it) and reaches policy-0."""
    from ray_forge.weights.collective import tensors_digest

    s = setup
    survivor, victim = s.policies
    version = ray_cluster.get(survivor.get_version.remote(), timeout=60)
    before = [t.text for t in _greedy(ray_cluster, survivor, s.prompts)]
    serving = s.fleet.serving
    ray_cluster.kill(victim, no_restart=False)

    async def scenario():
        await s.trainer.train_step(s.samples)
        start = time.monotonic()
        errors, loaded = await asyncio.gather(_publish_on_every_rank(s, 10), s.fleet.push(s.spec, 10))
        failed_in = time.monotonic() - start
        assert s.fleet.serving == serving  # the fleet knows policy-0 did not get version 10
        kept = await asyncio.wrap_future(survivor.get_version.remote().future())
        kept_texts = [t.text for t in await asyncio.wrap_future(survivor.generate.remote(s.prompts, greedy=True)
                                                                 .future())]
        session = await asyncio.wrap_future(s.store.controller.push_session.remote(10, 1).future())
        # The fleet now knows policy-1 is down: the next push leaves it out, in new groups.
        assert "policy-1" in s.fleet._recovering or "policy-1" in s.fleet.lost
        await _train_and_push(s, 11)
        rebuilt = await asyncio.wrap_future(s.store.controller.push_session.remote(11, 1).future())
        return errors, loaded, failed_in, kept, kept_texts, session, rebuilt

    errors, loaded, failed_in, kept, kept_texts, session, rebuilt = asyncio.run(scenario())
    assert failed_in < TIMEOUT_S
    for error in errors:
        assert "WeightSyncError" in str(error) and "policy-1 died" in str(error)
    assert loaded == {} and kept == version and kept_texts == before  # policy-0 did not get version 10
    assert session.receivers == s.spec.receivers
    assert rebuilt.generation > session.generation and rebuilt.receivers == (s.spec.receivers[0],)
    assert ray_cluster.get(survivor.get_version.remote(), timeout=60) == 11
    assert s.fleet.serving == 11
    want = tensors_digest(_trainer_state(ray_cluster, s, tmp_path).items())
    assert ray_cluster.get(survivor.weight_transfer_rpc.remote("weights_digest"), timeout=60) == [want]
    _assert_engine_computes_like_the_trainer(ray_cluster, s, survivor)



@pytest.mark.vllm
def test_a_restarted_engine_takes_part_in_the_next_push(ray_cluster, setup, tmp_path):
    """Ray restarted policy-1 (killed above): nothing is stored to catch up from, so it serves the
    base model and told the controller; the next push rebuilds the groups with it and it is exact."""
    from ray_forge.weights.collective import tensors_digest

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
    assert version == 0  # the base model until a push includes it
    before = ray_cluster.get(s.store.controller.push_session.remote(11, 1), timeout=60)
    asyncio.run(_train_and_push(s, 12))
    after = ray_cluster.get(s.store.controller.push_session.remote(12, 1), timeout=60)
    assert after.generation > before.generation and after.receivers == s.spec.receivers
    assert ray_cluster.get([p.get_version.remote() for p in s.policies], timeout=60) == [12, 12]
    want = tensors_digest(_trainer_state(ray_cluster, s, tmp_path).items())
    assert ray_cluster.get([p.weight_transfer_rpc.remote("weights_digest") for p in s.policies],
                           timeout=60) == [[want], [want]]
    _assert_engine_computes_like_the_trainer(ray_cluster, s, restarted)

# -- a peer killed mid-transfer, at the transport level (no vLLM: the engine's receive path alone) ------
def _transport_actors():
    import ray

    from ray_forge.weights.collective import tensors_digest
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
        """An engine worker's receiving half: staging, then the digest of what it would load."""

        def __init__(self) -> None:
            self.store = None

        def receive(self, spec: StoreSpec, version: int, name: str) -> str:
            self.store = self.store if self.store and self.store.spec == spec else WeightStore(spec)
            return tensors_digest(self.store.transport.receive(self.store, version, name))

    return Sender, Receiver, lambda: tensors_digest(big_state().items())


@pytest.mark.parametrize("victim", ["receiver", "sender"])
def test_a_peer_killed_mid_transfer_is_named_and_the_group_is_rebuilt(ray_cluster, victim):
    """800 buckets in flight; one receiver (or one sender rank) is killed once the bytes flow. The
    others fail within the timeout, naming it: the senders list the receiver that did not
    acknowledge, a receiver the sender rank whose bucket it was waiting for. A push rebuilt
    without the dead receiver then delivers the version exactly."""
    from ray_forge.weights.collective import close_push, open_push

    Sender, Receiver, digest = _transport_actors()
    tag = uuid.uuid4().hex[:6]
    names = (f"mid-{tag}-policy-0", f"mid-{tag}-policy-1")
    spec = StoreSpec(name=f"mid-{tag}", transport="collective", senders=("trainer-0", "trainer-1"), receivers=names,
                     timeout_s=TIMEOUT_S, bucket_bytes=2**16)
    store = WeightStore.create(spec)
    senders, receivers = [Sender.remote(r) for r in range(2)], [Receiver.remote() for _ in names]
    try:
        async def transfer(version: int, to: tuple[str, ...], kill=None) -> tuple[list, float]:
            session = await open_push(spec, version, to)
            calls = [s.push.remote(spec, version) for s in senders] + \
                    [r.receive.remote(spec, version, n) for r, n in zip(receivers, names) if n in to]
            start = time.monotonic()
            if kill is not None:
                await _flowing(session, version, len(to))
                ray_cluster.kill(kill)
            results = await asyncio.gather(*(asyncio.wrap_future(c.future()) for c in calls), return_exceptions=True)
            await close_push(spec, version)
            return results, time.monotonic() - start

        results, _ = asyncio.run(transfer(1, names))
        assert results[2:] == [digest(), digest()]  # exact, from two ranks' rows
        killed = receivers[1] if victim == "receiver" else senders[1]
        results, elapsed = asyncio.run(transfer(2, names, kill=killed))
        assert elapsed < TIMEOUT_S
        errors = [str(e) for e in results]
        if victim == "receiver":
            for sender_error in errors[:2]:
                assert "WeightSyncError" in sender_error
                assert sender_error.rstrip().endswith(f"receivers that did not acknowledge: {names[1]}")
            assert "WeightSyncError" in errors[2] and f"{names[0]}: bucket" in errors[2]
            assert "(trainer rank " in errors[2]
        else:
            for receiver_error in errors[2:]:
                assert "WeightSyncError" in receiver_error and "from trainer-1 (trainer rank 1)" in receiver_error
            return  # a dead trainer rank ends a job: nothing to rebuild for
        results, _ = asyncio.run(transfer(3, names[:1]))
        assert results[:2] == [r for r in results[:2] if isinstance(r, int)] and results[2] == digest()
    finally:
        for actor in [*senders, *receivers]:
            ray_cluster.kill(actor)
        store.destroy()


async def _flowing(session, version: int, num_receivers: int) -> None:
    """Return once every receiver said it is ready, i.e. the bytes have started to flow."""
    from datetime import timedelta

    import torch.distributed as dist

    client = dist.TCPStore(session.host, session.port, is_master=False, timeout=timedelta(seconds=30))
    from ray_forge.weights import version_key

    keys = [session.key(version_key(version), "ready", r) for r in range(1, 1 + num_receivers)]
    deadline = time.monotonic() + 60
    while not client.check(keys):
        assert time.monotonic() < deadline, "the receivers never got ready"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)


def test_a_publish_that_no_driver_opened_says_how_to_run_it(ray_cluster):
    """Over a push transport the trainer's publish and the fleet's push must run together; a driver
    that runs them one after the other gets this error, not a silent run with stale engines."""
    from ray_forge.weights.collective import PushNotOpened

    Sender, _, _ = _transport_actors()
    spec = StoreSpec(name=f"unopened-{uuid.uuid4().hex[:6]}", transport="collective",
                     senders=("trainer-0", "trainer-1"), receivers=("policy-0",), timeout_s=2)
    store = WeightStore.create(spec)
    sender = Sender.remote(0)
    try:
        start = time.monotonic()
        with pytest.raises(PushNotOpened, match="no push of weights version 1 was opened within 2s.*Fleet.push"):
            ray_cluster.get(sender.push.remote(spec, 1), timeout=60)
        assert time.monotonic() - start < 15
    finally:
        ray_cluster.kill(sender)
        store.destroy()
