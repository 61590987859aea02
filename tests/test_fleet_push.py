"""What the fleet does with weight syncs that fail (engines kept their version): the run goes on, and
stops with a clear error when they keep failing, rather than starving rollouts of a served version."""

import asyncio

import pytest

from ray_forge.run.fleet import MAX_FAILED_SYNCS, Fleet, FleetError
from ray_forge.weights import StoreSpec
from ray_forge.weights.sync import SyncRound


def test_failed_syncs_hold_the_served_version_then_stop_the_run(monkeypatch):
    fleet = Fleet([object(), object()], [], policy_timeout_s=30, env_timeout_s=30)
    spec = StoreSpec(name="sync-failures", transport="shm")
    # Whether each engine took its version, in sync order (policy-0, policy-1); False: its sync failed.
    outcomes = iter([True, True, False, True, False, True, True, True, False, False, True, False, False, True])

    async def update(name, round_):
        if not next(outcomes):
            return None
        fleet.held[name] = round_.version
        return {"load_s": 0.1, "paused_s": 0.1, "version": round_.version}

    monkeypatch.setattr(fleet.versions, "_update", update)
    served = []
    for version in range(1, 7):
        asyncio.run(fleet.sync(spec, version))
        served.append((fleet.serving, fleet.failed_syncs))
    # A failed sync keeps the served version; a whole one resets the count.
    assert served == [(1, 0), (1, 1), (1, 2), (4, 0), (4, 1), (4, 2)]
    assert MAX_FAILED_SYNCS == 3
    with pytest.raises(FleetError, match=r"could not be synced to \['policy-0'\] 3 times in a row \(last: version 7\)"):
        asyncio.run(fleet.sync(spec, 7))


def test_an_engine_that_a_version_cannot_reach_yet_is_not_serving_it(monkeypatch):
    """An engine that answers with its old version (a push it was not part of) keeps ``serving``
    where it was, like a failed sync; its timings are not the version's."""
    fleet = Fleet([object()], [], policy_timeout_s=30, env_timeout_s=30)
    spec = StoreSpec(name="sync-missed", transport="shm")

    async def update(name, round_):
        fleet.held[name] = 0
        return {"fetch_s": 0.5, "version": 0}

    monkeypatch.setattr(fleet.versions, "_update", update)
    assert asyncio.run(fleet.sync(spec, 1)) == {}
    assert (fleet.serving, fleet.failed_syncs) == (0, 1)


def test_a_closed_fleet_cancels_its_waits_for_restarts_and_starts_no_more(monkeypatch):
    """At a run's end (a dead trainer) the fleet is closed before its actors are shut down: a wait
    for an engine's restart is cancelled, and a call that fails after (its actor shut down) starts
    none, so no task outlives the event loop ("Task was destroyed but it is pending" was the last
    line of a job that had to end on the error)."""
    from ray_forge import identity

    fleet = Fleet([object(), object()], [], policy_timeout_s=30, env_timeout_s=30)
    asked = []

    async def never_back(name, timeout_s=None):
        asked.append(name)
        await asyncio.sleep(3600)

    monkeypatch.setattr(fleet.membership, "_whoami", never_back)

    async def scenario():
        async with asyncio.timeout(10):
            fleet.recover(identity.policy(0))
            await asyncio.sleep(0)
            assert fleet.down(identity.policy(0)) and asked == [identity.policy(0)]
            await fleet.close()
            fleet.recover(identity.policy(1))  # as a call to an actor being shut down would
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(scenario()) == []
    assert not fleet.down(identity.policy(0)) and not fleet.down(identity.policy(1)) and asked == [identity.policy(0)]


class _Trainer:
    async def publish_weights(self, spec, version) -> float:
        return 0.01


def test_a_sync_that_leaves_engines_further_behind_than_the_rollouts_may_lag_is_fetched_again(monkeypatch):
    """With ``buffer.max_policy_lag`` 0 (or ``fixed_lag``) the next step's games need the version
    just synced: a sync that failed on an engine would leave the rollouts waiting for a version no
    sync brings (the next one comes after the next step, which needs those games). The engines
    behind fetch it again from the store; with a lag of 1 a failed sync waits for the next step."""
    from ray_forge import identity

    def fleet_failing(lag: int, failures: int) -> tuple[Fleet, list]:
        fleet = Fleet([object(), object()], [], policy_timeout_s=30, env_timeout_s=30, lag=lag)
        asked = []

        async def update(name, round_):
            asked.append(str(name))
            if name == identity.policy(1) and asked.count(str(name)) <= failures:
                return None  # its fetch failed: it keeps its version
            fleet.held[name] = round_.version
            return {"load_s": 0.1, "version": round_.version}

        monkeypatch.setattr(fleet.versions, "_update", update)
        return fleet, asked

    spec = StoreSpec(name="sync-lag", transport="shm")
    fleet, asked = fleet_failing(lag=0, failures=1)
    asyncio.run(fleet.sync_weights(_Trainer(), spec, 1))
    assert asked == ["policy-0", "policy-1", "policy-1"] and (fleet.serving, fleet.failed_syncs) == (1, 0)

    fleet, asked = fleet_failing(lag=1, failures=2)
    asyncio.run(fleet.sync_weights(_Trainer(), spec, 1))
    assert asked == ["policy-0", "policy-1"] and (fleet.serving, fleet.failed_syncs) == (0, 1)
    asyncio.run(fleet.sync_weights(_Trainer(), spec, 2))  # a second in a row: now the rollouts would starve
    assert asked[2:] == ["policy-0", "policy-1", "policy-1"] and (fleet.serving, fleet.failed_syncs) == (2, 0)

    fleet, asked = fleet_failing(lag=0, failures=5)
    with pytest.raises(FleetError, match=r"could not be synced to \['policy-1'\] 3 times in a row \(last: version 1\)"):
        asyncio.run(fleet.sync_weights(_Trainer(), spec, 1))
    assert asked == ["policy-0", "policy-1", "policy-1", "policy-1"]

    fleet, asked = fleet_failing(lag=0, failures=1)
    fleet.versions.steps = 1  # the last step's version: no game waits for it
    asyncio.run(fleet.sync_weights(_Trainer(), spec, 1))
    assert asked == ["policy-0", "policy-1"] and (fleet.serving, fleet.failed_syncs) == (0, 1)

    fleet, asked = fleet_failing(lag=0, failures=1)
    pushed = StoreSpec(name="sync-lag-push", transport="collective", receivers=("policy-0", "policy-1"))
    monkeypatch.setattr("ray_forge.run.fleet.versions.SyncRound.open", _no_session)
    with pytest.raises(FleetError, match=r"weights version 1 reached no engine of \['policy-1'\].*a push is kept "
                                         r"nowhere to fetch again"):
        asyncio.run(fleet.sync_weights(_Trainer(), pushed, 1))
    assert asked == ["policy-0", "policy-1"]


_OPEN = SyncRound.open


async def _no_session(spec, version, engines, again=False):
    """A round without the controller's push session (this test's engines take nothing over the
    wire); a round again is the weight store's own answer."""
    return await _OPEN(spec, version, engines, again=True) if again else SyncRound(spec, version, tuple(engines))
