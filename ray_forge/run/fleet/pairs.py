"""Work for a live pair, an engine and an env actor: the first of each role up, waited for while
all are down, and started again on another pair when one dies under it. Only when a role has no
member up for ``capacity_timeout_s`` does the run stop, naming what its pool lacks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray_forge.identity import ActorId, Role
from ray_forge.remote import RemoteCallError
from ray_forge.run.fleet.membership import REJOIN_CHECK_S, FleetError, Membership

T = TypeVar("T")


class Pairs:
    def __init__(self, membership: Membership, *, capacity_timeout_s: float, needs: Callable[[Role], str]) -> None:
        self.membership = membership
        self.capacity_timeout_s = capacity_timeout_s
        """How long a role may have no member up before the run stops."""
        self.needs = needs
        """What one member of a role needs from its pool, in words (the stop's message says it)."""

    async def on_live(self, run: Callable[[ActorId, ActorId, int], Awaitable[T]], *, at: Callable[[int], int],
                      attempts: int, died: Callable[[RemoteCallError], None], gave_up: str | None = None) -> T:
        """``run(engine, env actor, attempt)`` on the first of each role up from index ``at(attempt)``
        on. When either dies under it: ``died`` says so, the dead one is recovered and ``run`` starts
        again on the pair up then, ``attempts`` times in all; then a FleetError saying ``gave_up``,
        or without it the last death itself."""
        for attempt in range(attempts):
            engine, env = await self.pick(Role.POLICY, at(attempt)), await self.pick(Role.ENV, at(attempt))
            try:
                return await run(engine, env, attempt)
            except RemoteCallError as err:
                if not err.died or err.actor not in (engine, env) or (gave_up is None and attempt == attempts - 1):
                    raise
                died(err)
                self.membership.recover(err.actor)
        raise FleetError(gave_up)

    async def pick(self, role: Role, start: int) -> ActorId:
        """The first live member of ``role`` from index ``start`` on; waits while all are down, for
        at most ``capacity_timeout_s`` since the last of them went down."""
        while True:
            num = self.membership.num[role]
            names = [ActorId(role, (start + k) % num) for k in range(num)]
            live = [n for n in names if not self.membership.down(n)]
            if live:
                return live[0]
            now = time.monotonic()
            waited = now - max(self.membership.down_at.get(n, now) for n in names)
            waiting = [self.membership.recovering[n] for n in names if n in self.membership.recovering]
            if not waiting or waited > self.capacity_timeout_s:
                raise FleetError(f"no {role} actor has been up for {waited:.0f}s (cluster.capacity_timeout_s "
                                 f"{self.capacity_timeout_s:.0f}s): Ray could not start {', '.join(map(str, names))} "
                                 f"again; {self.needs(role)}")
            await asyncio.wait(waiting, timeout=min(REJOIN_CHECK_S, self.capacity_timeout_s - waited + 0.1),
                               return_when=asyncio.FIRST_COMPLETED)
