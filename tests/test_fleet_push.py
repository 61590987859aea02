"""What the fleet does with pushes that fail (engines kept their version): the run goes on, and
stops with a clear error when they keep failing, rather than starving rollouts of a served version."""

import asyncio

import pytest

from ray_forge.run.fleet import MAX_FAILED_PUSHES, Fleet, FleetError
from ray_forge.weights import StoreSpec


def test_failed_pushes_hold_the_served_version_then_stop_the_run(monkeypatch):
    fleet = Fleet([object(), object()], [], policy_timeout_s=30, env_timeout_s=30)
    spec = StoreSpec(name="push-failures", transport="shm")
    # Seconds each engine took, in push order (policy-0, policy-1); None: its transfer failed.
    outcomes = iter([0.1, 0.1, None, 0.1, None, 0.1, 0.1, 0.1, None, None, 0.1, None, None, 0.1])

    async def update(name, spec, version, session=None):
        seconds = next(outcomes)
        return None if seconds is None else {"load_s": seconds, "paused_s": seconds}

    monkeypatch.setattr(fleet, "_update", update)
    served = []
    for version in range(1, 7):
        asyncio.run(fleet.push(spec, version))
        served.append((fleet.serving, fleet.failed_pushes))
    # A failed push keeps the served version; a whole one resets the count.
    assert served == [(1, 0), (1, 1), (1, 2), (4, 0), (4, 1), (4, 2)]
    assert MAX_FAILED_PUSHES == 3
    with pytest.raises(FleetError, match=r"could not be pushed to \['policy-0'\] 3 times in a row \(last: version 7\)"):
        asyncio.run(fleet.push(spec, 7))
