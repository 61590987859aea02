"""Placement pools, env actors driven by the rollout, and remote-call failures, on a local Ray cluster."""

import asyncio
import time

import pytest
import ray

from envs import registry
from ray_forge.actors.env_pool import EnvPoolActor
from ray_forge.actors.rollout import RolloutSettings
from ray_forge.cluster.pools import PlacementError, Pools, Slot
from ray_forge.config.schema import BufferConfig, ClusterConfig, EnvConfig, Resources
from ray_forge import identity
from ray_forge.core.env import StepResult
from ray_forge.core.episode import Turn
from ray_forge.remote import RemoteCallError, call

pytestmark = pytest.mark.ray


class ScriptedPolicy:
    """A typed stand-in for the vLLM actor: answers by a fixed rule (the real engine is tested elsewhere)."""

    def __init__(self, answer_for_sum):
        self.answer_for_sum = answer_for_sum

    def generate(self, prompts: list[str], greedy: bool = False, seed: int | None = None,
                 priority: int = 0) -> list[Turn]:
        out = []
        for p in prompts:
            player_sum = int(p.split()[3].rstrip(","))
            out.append(Turn((1, 2, player_sum), (9,), (-0.5,), 7, self.answer_for_sum(player_sum)))
        return out


def test_pools_keep_bundles_for_pinned_roles_and_place_restarted_ones_by_label(ray_cluster):
    """Each pool is reserved whole; the trainer keeps its bundle, while engines and env actors (which
    Ray restarts wherever their label has room) are placed outside any placement group: a placed
    group that loses a node makes Ray's GCS spin (see ``pools``)."""
    by_pool = {"gpu": [("trainer", Resources(pool="gpu", num_cpus=0.5)), ("policy", Resources(pool="gpu", num_cpus=0.5))],
               "cpu": [("env", Resources(pool="cpu", num_cpus=0.25))] * 2}
    pools = Pools(ClusterConfig(placement_timeout_s=30), by_pool)  # this one-node cluster has no labelled node
    try:
        env_options = [slot.options(f"env-pooltest-{i}") for i, slot in enumerate(pools.slots["env"])]
        assert "scheduling_strategy" not in env_options[0] and env_options[0]["num_cpus"] == 0.25
        assert "scheduling_strategy" in pools.slots["trainer"][0].options("trainer-pooltest")
        labelled = Slot(Resources(pool="gpu", num_cpus=0.5), label="gpu-nodes").options("policy-pooltest")
        assert labelled["label_selector"] == {"ray_forge/pool": "gpu-nodes"} and "scheduling_strategy" not in labelled
        envs = [EnvPoolActor.options(**o).remote(EnvConfig(), registry.get("blackjack").setup({})) for o in env_options]
        assert ray.get([e.node_id.remote() for e in envs], timeout=60)
        assert ray.get_actor("env-pooltest-1") is not None
        table = ray.util.placement_group_table()
        names = {v["name"]: v for v in table.values() if v["state"] == "CREATED"}
        assert names["ray_forge-gpu"]["bundles"] == {0: {"CPU": 0.5}}  # the trainer's alone
        assert "ray_forge-cpu" not in names  # reserved whole at start, then released
        for e in envs:
            ray.kill(e)
    finally:
        pools.release()


def test_the_fleet_cancels_its_calls_to_a_member_that_goes_down(ray_cluster):
    """A call queued to a member when the fleet finds it down is cancelled (Ray would keep it queued
    behind a restart that may never come), and its caller hears that the member is down."""
    from ray_forge.run.fleet import Fleet

    @ray.remote(num_cpus=0, max_concurrency=1)
    class Busy:
        def hold(self, seconds: float) -> None:
            time.sleep(seconds)

        def whoami(self) -> tuple[int, int]:
            return 1, 0

    busy, slow = Busy.remote(), Busy.remote()
    fleet = Fleet([], [busy, slow], policy_timeout_s=30, env_timeout_s=30)
    env, slow_env = identity.all_of(identity.Role.ENV, 2)

    async def scenario() -> None:
        for actor in (busy, slow):
            actor.hold.remote(3.0)  # the member is busy: the next call waits in its queue
        ref = busy.whoami.remote()
        queued = asyncio.ensure_future(fleet._call(env, ref, timeout_s=30, what="whoami"))
        kept = asyncio.ensure_future(fleet._call(slow_env, slow.whoami.remote(), timeout_s=30, what="whoami"))
        await asyncio.sleep(0.5)
        assert len(fleet.calls[env]) == 1
        fleet.recover(env)
        fleet.recover(slow_env, died=False)  # only slow to answer a roll call: its calls may still end well
        with pytest.raises(RemoteCallError, match="env-0.whoami was cancelled: the actor is down") as err:
            await asyncio.wait_for(queued, timeout=20)
        assert err.value.died and ref not in fleet.calls.get(env, ())  # what is left is the one rejoin probe
        assert await asyncio.wait_for(kept, timeout=20) == (1, 0)
        await fleet.close()

    asyncio.run(scenario())
    for actor in (busy, slow):
        ray.kill(actor)


def test_unplaceable_pool_fails_with_a_clear_error(ray_cluster):
    start = time.monotonic()
    config = ClusterConfig(placement_timeout_s=2, pool_labels={"gpu": "gpu-nodes"})
    with pytest.raises(PlacementError, match="ray_forge/pool=gpu-nodes"):
        Pools(config, {"gpu": [("trainer", Resources(pool="gpu", num_cpus=1.0))]})
    with pytest.raises(PlacementError, match="pool 'gpu' needs"):
        Pools(ClusterConfig(placement_timeout_s=2), {"gpu": [("trainer", Resources(pool="gpu", num_cpus=64.0))]})
    assert time.monotonic() - start < 30


def test_rollout_plays_grouped_games_on_env_actors(ray_cluster):
    policy = ray.remote(ScriptedPolicy).options(num_cpus=0).remote(lambda s: "HIT" if s < 12 else "STICK")
    env = EnvPoolActor.options(num_cpus=0).remote(EnvConfig(), registry.get("blackjack").setup({}))
    settings = RolloutSettings(group_size=4, max_turns=10, invalid_action_penalty=-1.0,
                               policy_timeout_s=30, env_timeout_s=30)
    groups = ray.get(env.play.remote(policy, "policy", [(0, 11), (1, 12)], settings, 0), timeout=60)
    assert [len(g) for g in groups] == [4, 4]
    for group in groups:
        # Same seed and a deterministic policy: identical games within the group.
        assert len({(e.reward, len(e.turns)) for e in group}) == 1
        for e in group:
            assert e.error is None and e.policy_version == 7
            assert all(t.prompt_ids[-1] < 12 for t in e.turns[:-1])  # hit only below 12
    ray.kill(policy)
    ray.kill(env)


def test_a_rollout_worker_plays_beside_its_envs_and_fills_the_buffer(ray_cluster):
    """The env actor runs the game loop itself and puts each chunk into the buffer; the caller gets
    counts only, a batch enters the buffer once all its chunks are in, and a policy that dies
    mid-game is named in the error, so the fleet can replay the chunk elsewhere."""
    from ray_forge.actors.buffer import BufferActor
    from ray_forge.remote import call

    policy = ray.remote(ScriptedPolicy).options(num_cpus=0).remote(lambda s: "HIT" if s < 12 else "STICK")
    env = EnvPoolActor.options(num_cpus=0).remote(EnvConfig(), registry.get("blackjack").setup({}))
    buffer = BufferActor.options(num_cpus=0).remote(BufferConfig(max_policy_lag=5))
    settings = RolloutSettings(group_size=4, max_turns=10, invalid_action_penalty=-1.0,
                               policy_timeout_s=30, env_timeout_s=30)

    async def play(chunk, groups, policy=policy, name=identity.policy(0)):
        return await call(env.play.remote(policy, name, groups, settings, chunk, (buffer, 0, chunk, 2)),
                          timeout_s=60, what="play", actor=identity.env(0))

    first = asyncio.run(play(0, [(0, 11), (1, 12)]))
    assert first["games"] == 8 and first["tokens"] >= 8 and set(first) == {"games", "tokens"}
    assert ray.get(buffer.stats.remote(), timeout=30)["generated"] == 0  # half a batch is not in yet
    asyncio.run(play(1, [(2, 13)]))
    stats = ray.get(buffer.stats.remote(), timeout=30)
    assert stats["generated"] == 12 and ray.get(buffer.state.remote(), timeout=30)["next_batch"] == 1

    dead = ray.remote(ScriptedPolicy).options(num_cpus=0).remote(lambda s: "HIT")
    ray.kill(dead)
    with pytest.raises(RemoteCallError, match="policy-1.generate failed: the actor died") as err:
        asyncio.run(play(0, [(3, 14)], policy=dead, name=identity.policy(1)))
    assert err.value.died and err.value.actor == identity.policy(1)
    for actor in (policy, env, buffer):
        ray.kill(actor)


def test_garbage_actions_and_endless_games_are_penalised(ray_cluster):
    env = EnvPoolActor.options(num_cpus=0).remote(EnvConfig(), registry.get("blackjack").setup({}))
    settings = RolloutSettings(group_size=2, max_turns=3, invalid_action_penalty=-2.0,
                               policy_timeout_s=30, env_timeout_s=30)
    garbage = ray.remote(ScriptedPolicy).options(num_cpus=0).remote(lambda s: "<unk> 7 ,")
    [group] = ray.get(env.play.remote(garbage, "policy", [(0, 3)], settings, 0), timeout=60)
    assert all(e.error == "invalid action" and e.reward == -1.0 for e in group)
    ray.kill(garbage)


def test_empty_output_ends_the_game_as_an_invalid_action(ray_cluster):
    settings = RolloutSettings(group_size=2, max_turns=4, invalid_action_penalty=-1.0,
                               policy_timeout_s=30, env_timeout_s=30)
    empty = ray.remote(ScriptedPolicy).options(num_cpus=0).remote(lambda s: "")
    env = EnvPoolActor.options(num_cpus=0).remote(EnvConfig(), registry.get("blackjack").setup({}))
    [group] = ray.get(env.play.remote(empty, "policy", [(0, 3)], settings, 0), timeout=60)
    assert all(e.error == "invalid action" and e.reward == -1.0 and len(e.turns) == 1 for e in group)
    for actor in (empty, env):
        ray.kill(actor)


def test_a_reset_that_raises_ends_only_that_game():
    from ray_forge.actors.env_pool import EnvPool

    pool = EnvPool(EnvConfig(), registry.get("blackjack").setup({}))
    pool._make = lambda: Flaky()
    pool._free.clear()
    starts = pool.reset(0, [1, 13, 2])
    assert [s.done for s in starts] == [False, True, False]
    assert starts[1].reward == -1.0 and "env reset error: seed 13 refused" in starts[1].info["error"]
    assert pool.step(0, [0], ["STICK"])[0].done


class Flaky:
    """BlackJack whose reset raises for seed 13."""

    action_words = ("HIT", "STICK")

    def __init__(self) -> None:
        from envs.blackjack import BlackjackTextEnv

        self.env = BlackjackTextEnv()

    def reset(self, seed: int) -> str:
        if seed == 13:
            raise ConnectionError("seed 13 refused")
        return self.env.reset(seed)

    def step(self, action: str) -> StepResult:
        return self.env.step(action)


def test_dead_actor_is_named_in_the_error(ray_cluster):
    env = EnvPoolActor.options(num_cpus=0).remote(EnvConfig(), registry.get("blackjack").setup({}))
    ray.get(env.get_action_words.remote())
    ray.kill(env)
    start = time.monotonic()
    with pytest.raises(RemoteCallError, match="env-7.reset failed: the actor died"):
        asyncio.run(call(env.reset.remote(0, [1]), timeout_s=20, what="reset", actor=identity.env(7)))
    assert time.monotonic() - start < 20


def test_slow_actor_times_out_with_its_name(ray_cluster):
    @ray.remote(num_cpus=0)
    class Sleeper:
        def wait(self, s):
            time.sleep(s)

    sleeper = Sleeper.remote()
    with pytest.raises(RemoteCallError, match="policy-3.generate did not answer within 1s"):
        asyncio.run(call(sleeper.wait.remote(30), timeout_s=1, what="generate", actor=identity.policy(3)))
    ray.kill(sleeper)
