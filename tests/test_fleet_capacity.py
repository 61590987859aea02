"""Members that do not come back (their node lost, and no room to start them elsewhere): the run goes
on without them and takes them back when Ray starts them again; with no member of a role up for
``cluster.capacity_timeout_s`` it stops, naming what the role's pool lacks. Never an endless wait."""

import asyncio
import logging

import pytest

from ray_forge import identity
from ray_forge.identity import Role
from ray_forge.remote import RemoteCallError
from ray_forge.run.fleet import engine_nodes
from ray_forge.run.fleet import membership as fleet_module
from ray_forge.run.fleet import Fleet, FleetError


def _answering(fleet: Fleet, monkeypatch, pids: dict) -> None:
    """Members answer ``whoami`` with ``pids[name]``; one whose pid is None does not answer in time.
    Engines' nodes are made up: no node of them is lost (``nodes.lost`` answers for unknown ones)."""
    async def whoami(name, timeout_s=None):
        if pids.get(name) is None:
            await asyncio.sleep(timeout_s or 0.05)
            raise RemoteCallError(f"{name}.whoami did not answer", "whoami", actor=name)
        return pids[name], 0

    async def node_of(name):
        fleet.engine_nodes[name] = "node-of-" + str(name)

    monkeypatch.setattr(fleet.membership, "_whoami", whoami)
    monkeypatch.setattr(fleet.membership.engine_nodes, "note_node", node_of)
    monkeypatch.setattr(fleet_module, "REJOIN_CHECK_S", 0.05)


async def _until(holds, timeout_s: float = 10.0) -> None:
    """Until ``holds()``; fails past ``timeout_s`` rather than hang."""
    async def poll() -> None:
        while not holds():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), timeout=timeout_s)


def test_with_no_member_of_a_role_up_the_run_stops_within_the_placement_timeout_naming_what_is_missing(monkeypatch):
    fleet = Fleet([object()], [object(), object()], policy_timeout_s=5, env_timeout_s=0.2, capacity_timeout_s=1.0,
                  needs=lambda role: f"pool cpu lacks {{'CPU': 0.25}} for each {role} actor")
    _answering(fleet, monkeypatch, {})

    async def scenario() -> float:
        for name in identity.all_of(Role.ENV, 2):
            fleet.recover(name)
        start = asyncio.get_running_loop().time()
        with pytest.raises(FleetError, match=r"no env actor has been up for \d+s \(cluster.capacity_timeout_s 1s\): "
                                             r"Ray could not start env-0, env-1 again; pool cpu lacks \{'CPU': 0.25\} "
                                             r"for each env actor"):
            await fleet._pick(Role.ENV, 0)
        waited = asyncio.get_running_loop().time() - start
        await fleet.close()
        return waited

    assert asyncio.run(scenario()) < 10.0  # bounded: the timeout and one retry, not a hang
    assert fleet.lost == set(identity.all_of(Role.ENV, 2))  # past their own timeout, before the run's


def test_an_engine_not_back_in_time_is_left_out_and_rejoins_when_it_is(monkeypatch, caplog):
    policy_0, policy_1 = identity.all_of(Role.POLICY, 2)
    fleet = Fleet([object(), object()], [], policy_timeout_s=0.2, env_timeout_s=5)
    pids = {policy_0: 100, policy_1: None}
    fleet.membership.pids = {policy_0: 100, policy_1: 101}
    _answering(fleet, monkeypatch, pids)

    async def scenario() -> None:
        fleet.recover(policy_1)
        await _until(lambda: policy_1 in fleet.lost)
        assert await fleet._pick(Role.POLICY, 1) == policy_0  # its games go to the engine left
        assert fleet.engines_up() == [policy_0] and fleet.stats()["actors_lost"] == 1
        assert fleet.stats()["actors_restarting"] == 0  # given up on (still waited for): lost, not also restarting
        await asyncio.wait_for(fleet.settle(), timeout=5)  # the run's end does not wait for a lost one
        pids[policy_1] = 202  # Ray placed it again: a new process
        await _until(lambda: not fleet.down(policy_1))
        await fleet.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert "policy-1 is not back after 0s" in caplog.text
    assert "the run goes on with 1 of 2 policy actors" in caplog.text
    assert "policy-1 is back after" in caplog.text and "rejoins the run" in caplog.text
    assert fleet.lost == set() and fleet.engines_up() == [policy_0, policy_1]
    assert fleet.stats()["actor_restarts"] == 1 and fleet.pids[policy_1] == 202


def test_the_roll_call_counts_a_member_that_restarted_while_idle(monkeypatch):
    """No call of the fleet met its death: only its new process tells."""
    env_0 = identity.env(0)
    fleet = Fleet([], [object()], policy_timeout_s=5, env_timeout_s=5)
    pids = {env_0: 300}
    _answering(fleet, monkeypatch, pids)
    asyncio.run(fleet.start())
    asyncio.run(fleet.roll_call())
    assert fleet.stats()["actor_restarts"] == 0
    pids[env_0] = 301
    asyncio.run(fleet.roll_call())
    assert fleet.stats()["actor_restarts"] == 1


def test_the_roll_call_leaves_out_a_member_that_cannot_answer(monkeypatch):
    """A member waiting for a node to restart on does not answer: it gets no games until it does."""
    env_0, env_1 = identity.all_of(Role.ENV, 2)
    fleet = Fleet([], [object(), object()], policy_timeout_s=5, env_timeout_s=5)
    pids = {env_0: 300, env_1: 400}
    _answering(fleet, monkeypatch, pids)

    async def scenario() -> None:
        await fleet.start()
        pids[env_1] = None
        await fleet.roll_call()
        assert fleet.down(env_1) and not fleet.down(env_0)
        assert await fleet._pick(Role.ENV, 1) == env_0
        await fleet.close()

    asyncio.run(scenario())


def test_an_engine_that_dies_again_while_it_catches_up_is_waited_for_again(monkeypatch, caplog):
    policy_0 = identity.policy(0)
    fleet = Fleet([object()], [], policy_timeout_s=5, env_timeout_s=5)
    pids = {policy_0: 500}
    fleet.membership.pids = {policy_0: 100}
    _answering(fleet, monkeypatch, pids)
    syncs = []

    async def sync(name, version):
        syncs.append(pids[name])
        if len(syncs) == 1:
            pids[name] = 600  # it died during its catch-up and Ray started it again
            raise RemoteCallError(f"{name}.update_weights failed: the actor died", "update_weights", died=True,
                                  actor=name)

    monkeypatch.setattr(fleet.versions, "catch_up", sync)

    async def scenario() -> None:
        fleet.recover(policy_0)
        await _until(lambda: not fleet.down(policy_0))
        await fleet.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert syncs == [500, 600] and fleet.pids[policy_0] == 600 and fleet.stats()["actor_restarts"] == 2
    assert "while catching up; waiting for it again" in caplog.text


def test_a_member_that_is_down_is_asked_once_per_rejoin_check(monkeypatch):
    """Its probe fails at once (Ray cannot reach it): the next one waits for the next check, so the
    driver's calls to it stay at one per ``REJOIN_CHECK_S``, not one per failure."""
    policy_0, policy_1 = identity.all_of(Role.POLICY, 2)
    fleet = Fleet([object(), object()], [], policy_timeout_s=30, env_timeout_s=30)
    _answering(fleet, monkeypatch, {policy_0: 100})
    monkeypatch.setattr(fleet_module, "REJOIN_CHECK_S", 0.1)
    asked = []

    async def unreachable(name, timeout_s=None):
        asked.append(asyncio.get_running_loop().time())
        raise RemoteCallError(f"{name}.whoami failed: the actor died (unavailable)", "whoami", died=True, actor=name)

    monkeypatch.setattr(fleet.membership, "_whoami", unreachable)

    async def scenario() -> None:
        fleet.recover(policy_1)
        await asyncio.sleep(1.0)
        await fleet.close()

    asyncio.run(scenario())
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert 5 <= len(asked) <= 11 and min(gaps) >= 0.09, (len(asked), gaps)


def test_the_weight_store_stops_waiting_for_an_engine_on_a_lost_node_as_soon_as_it_goes_down(monkeypatch):
    """A lost node takes the engine's reads in flight with it, and Ray may declare the node dead only
    a minute later: the store is told when the engine goes down, before its first rejoin check. One
    down on a node that is there (it may only be unreachable, and still reading) is not told."""
    policy_0, policy_1 = identity.all_of(Role.POLICY, 2)
    fleet = Fleet([object(), object()], [], policy_timeout_s=30, env_timeout_s=30)
    pids = {policy_0: None, policy_1: None}
    fleet.membership.pids = {policy_0: 100, policy_1: 101}
    fleet.membership.engine_nodes.of = {policy_0: "node-0", policy_1: "node-1"}
    fleet.versions.spec = object()  # a sync happened: there are versions to read
    _answering(fleet, monkeypatch, pids)
    monkeypatch.setattr(fleet_module, "REJOIN_CHECK_S", 5.0)  # no rejoin check comes within the test
    monkeypatch.setattr(engine_nodes.nodes, "lost", lambda node_id: node_id == "node-1")
    told = []

    class Store:
        def __init__(self, spec) -> None:
            assert spec is fleet.spec

        async def receiver_gone(self, name: str, pid: int) -> None:
            told.append((name, pid))

    monkeypatch.setattr(engine_nodes, "ControllerClient", Store)

    async def scenario() -> None:
        fleet.recover(policy_1)
        fleet.recover(policy_0)
        await _until(lambda: told, timeout_s=2.0)  # before the first rejoin check
        await asyncio.sleep(0.2)
        await fleet.close()

    asyncio.run(scenario())
    assert told == [("policy-1", 101)]


def test_a_wait_for_a_member_that_fails_is_said_once_not_left_for_python_to_print_at_exit(monkeypatch, caplog):
    """No one awaits a member's wait for its restart: an error in it (the run ending under it) is
    logged as one line, so the job's last lines are its own, not "Task exception was never retrieved"."""
    import gc

    env_0 = identity.env(0)
    fleet = Fleet([], [object()], policy_timeout_s=5, env_timeout_s=5)
    fleet.membership.pids = {env_0: 300}

    async def whoami(name, timeout_s=None):
        raise ValueError("the cluster is shutting down")

    monkeypatch.setattr(fleet.membership, "_whoami", whoami)

    async def scenario() -> None:
        fleet.recover(env_0)
        await _until(lambda: not fleet.down(env_0))
        await fleet.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
        gc.collect()
    assert "waiting for env-0 to come back failed: ValueError: the cluster is shutting down" in caplog.text
    assert "never retrieved" not in caplog.text
