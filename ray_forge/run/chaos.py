"""Faults on purpose: kill an env actor or a policy engine about every ``chaos.every_s`` seconds.

The kill is Ray's own (``ray.kill(..., no_restart=False)``): the actor's process dies at once,
whatever it is doing, and Ray restarts it as it would after a crash or a lost node. The schedule
(who, and the jitter of the interval) is drawn from ``chaos.seed``.
"""

from __future__ import annotations

import asyncio
import logging
import random

import ray

from ray_forge.config.schema import ChaosConfig
from ray_forge.identity import ActorId

log = logging.getLogger(__name__)


def victims(config: ChaosConfig, members: list[ActorId]) -> list[ActorId]:
    """The actors the config allows to be killed: a role (``env``) or an actor (``policy-1``)."""
    return [m for m in members if m.matches(config.targets)]


async def chaos_monkey(config: ChaosConfig, fleet, stop: asyncio.Event) -> None:
    """Until ``stop`` is set: wait ``every_s`` (x0.5 to x1.5), kill one allowed actor, append it to
    ``fleet.chaos_kills``. An actor is spared while it restarts (Ray says it is not alive yet):
    killing an engine again before it is up would only show that it cannot start. If the drawn
    one is restarting, another is drawn; if all are, the kill waits. A kill also waits until the
    fleet has played a chunk to its end since the last one: on a slow machine the faults come
    slower, never so fast that no chunk can finish (which would only show the machine's speed)."""
    rng = random.Random(config.seed)
    allowed = victims(config, sorted(fleet.members))
    if not allowed:
        raise ValueError(f"chaos.targets {config.targets} match no actor of {[str(m) for m in sorted(fleet.members)]}")
    done_at_kill = -1
    while True:
        if await _stopped(stop, config.every_s * rng.uniform(0.5, 1.5)):
            return
        while fleet.plays_done <= done_at_kill:
            if await _stopped(stop, 0.5):
                return
        name = rng.choice(allowed)
        while not _up(fleet, name):
            up = [n for n in allowed if _up(fleet, n)]
            if up:
                name = rng.choice(up)
                break
            if await _stopped(stop, 0.5):
                return
        done_at_kill = fleet.plays_done
        log.warning("chaos: killing %s", name)
        ray.kill(fleet.members[name], no_restart=False)
        fleet.chaos_kills.append(name)
        await asyncio.sleep(1.0)  # Ray marks it restarting within this; never count a kill on a corpse


async def _stopped(stop: asyncio.Event, wait_s: float) -> bool:
    """Whether ``stop`` was set within ``wait_s``."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=wait_s)
        return True
    except asyncio.TimeoutError:
        return False


def _up(fleet, name: ActorId) -> bool:
    state = fleet.ray_restarts(name)
    return state is None or state[1]
