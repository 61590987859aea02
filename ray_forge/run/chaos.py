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

log = logging.getLogger(__name__)


def victims(config: ChaosConfig, names: list[str]) -> list[str]:
    """The actors the config allows to be killed: a role (``env``) or an actor's name (``policy-1``)."""
    return [n for n in names if n in config.targets or n.split("-")[0] in config.targets]


async def chaos_monkey(config: ChaosConfig, fleet, stop: asyncio.Event, kills: list[str]) -> None:
    """Until ``stop`` is set: wait ``every_s`` (x0.5 to x1.5), kill one allowed actor, append its
    name to ``kills``. An actor is spared while it restarts (Ray says it is not alive yet):
    killing an engine again before it is up would only show that it cannot start. If the drawn
    one is restarting, another is drawn; if all are, the kill waits."""
    rng = random.Random(config.seed)
    allowed = victims(config, sorted(fleet.members))
    if not allowed:
        raise ValueError(f"chaos.targets {config.targets} match no actor of {sorted(fleet.members)}")
    while True:
        try:
            await asyncio.wait_for(stop.wait(), timeout=config.every_s * rng.uniform(0.5, 1.5))
            return
        except asyncio.TimeoutError:
            pass
        name = rng.choice(allowed)
        while not _up(fleet, name):
            up = [n for n in allowed if _up(fleet, n)]
            if up:
                name = rng.choice(up)
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
                return
            except asyncio.TimeoutError:
                pass
        log.warning("chaos: killing %s", name)
        ray.kill(fleet.members[name], no_restart=False)
        kills.append(name)
        await asyncio.sleep(1.0)  # Ray marks it restarting within this; never count a kill on a corpse


def _up(fleet, name: str) -> bool:
    state = fleet.ray_restarts(name)
    return state is None or state[1]
