"""The fleet's parts on their own: a wait for a served version, and the counts a resume carries."""

import asyncio

from ray_forge import identity
from ray_forge.run.fleet import CARRIED, Fleet
from ray_forge.run.fleet.counters import Counters
from ray_forge.weights import StoreSpec


def test_a_wait_for_a_served_version_ends_when_every_live_engine_holds_it_and_not_before(monkeypatch):
    fleet = Fleet([object(), object()], [], policy_timeout_s=30, env_timeout_s=30)
    spec = StoreSpec(name="until-serving", transport="shm")
    failing = set()

    async def update(name, round_):
        if name in failing:
            return None  # its fetch failed: it keeps its version
        fleet.held[name] = round_.version
        return {"load_s": 0.1, "version": round_.version}

    monkeypatch.setattr(fleet.versions, "_update", update)

    async def scenario() -> None:
        await asyncio.wait_for(fleet.until_serving(0), timeout=1)  # served already: no wait
        waiter = asyncio.create_task(fleet.until_serving(2))
        await fleet.sync(spec, 1)
        await asyncio.sleep(0)
        assert fleet.serving == 1 and not waiter.done()  # a move short of the version goes on waiting
        failing.add(identity.policy(1))
        await fleet.sync(spec, 2)
        await asyncio.sleep(0)
        assert fleet.serving == 1 and not waiter.done()  # one engine missed it: not served
        failing.clear()
        await fleet.sync(spec, 2)
        await asyncio.wait_for(waiter, timeout=1)
        assert fleet.serving == 2

    asyncio.run(scenario())


def test_the_carried_counts_survive_a_round_trip_and_go_on_from_there():
    before = Counters()
    before.restarted()
    before.replayed(8)
    before.killed(identity.env(0))
    saved = before.state_dict()
    assert saved == {"actor_restarts": 1, "replayed_games": 8, "chaos_kills": 1, "nodes_lost": 0}
    assert tuple(saved) == CARRIED

    resumed = Fleet([], [object()], policy_timeout_s=5, env_timeout_s=5)
    resumed.counters.load_state_dict(saved)
    assert resumed.counters.state_dict() == saved
    resumed.counters.restarted()
    assert resumed.stats() == dict(saved, actor_restarts=2, actors_restarting=0, actors_lost=0)


def test_a_checkpoint_from_before_the_counts_moved_resumes_with_them():
    """Driver states written before the checkpoint manager kept the fleet's counts under ``counts``."""
    older = {"step": 4, "counts": {"actor_restarts": 2, "replayed_games": 16, "chaos_kills": 1, "nodes_lost": 0}}
    counters = Counters()
    counters.load_state_dict(older)
    assert counters.state_dict() == older["counts"]
