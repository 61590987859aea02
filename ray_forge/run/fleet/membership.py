"""Which members are up, their restarts, and the driver's calls to them.

Ray restarts a dead member (``max_restarts``); the fleet waits for it, counts it, and brings an
engine to the fleet's version (``catch_up``). A member not back within its role's timeout is
``lost``: the run goes on without it and it rejoins whenever Ray places it again.

A member that is down is not called but to ask whether it is back: one call each
``REJOIN_CHECK_S``, cancelled when it is not answered in time (Ray queues a call to a restarting
actor until it is placed, for as long as that takes). Calls in flight to it when it went down are
cancelled; the weight store is told of an engine whose node was lost (``engine_nodes``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ray_forge.identity import ActorId, Role
from ray_forge.remote import RemoteCallError
from ray_forge.run.fleet.calls import Calls
from ray_forge.run.fleet.counters import Counters
from ray_forge.run.fleet.engine_nodes import EngineNodes
from ray_forge.weights import StoreSpec

log = logging.getLogger(__name__)


class FleetError(RuntimeError):
    """No live member of a role is left, or a batch failed on every one."""


REJOIN_CHECK_S = 10.0
"""How often a member that is down is asked (one call) whether it is back; also how long a member
up has to answer the roll call, and how long a wait for a free member sleeps at most."""


class Membership:
    def __init__(self, members: dict[ActorId, object], counters: Counters, *, timeout_s: dict[Role, float],
                 catch_up: Callable[[ActorId, int], Awaitable[None]], store: Callable[[], StoreSpec | None]) -> None:
        self.members = members
        self.counters = counters
        self.calls = Calls()
        self.num = {role: sum(name.role is role for name in members) for role in (Role.POLICY, Role.ENV)}
        self.timeout_s = timeout_s
        self.catch_up = catch_up
        """Brings an engine that is back from the version it holds to the fleet's."""
        self.down_at: dict[ActorId, float] = {}
        """When each member that is down now was found dead."""
        self.pids: dict[ActorId, int] = {}
        self.recovering: dict[ActorId, asyncio.Task] = {}
        """The wait for each member that is down, until it is back (or the fleet closes)."""
        self.closed = False
        self.lost: set[ActorId] = set()
        """Members not back within their role's timeout: the run goes on without them until they are."""
        self.engine_nodes = EngineNodes(members, self.calls, timeout_s=timeout_s[Role.POLICY], store=store)

    async def start(self) -> None:
        """Record each member's process, to tell a restart from a slow answer later, and each
        engine's node."""
        answers = await asyncio.gather(*(self._whoami(name) for name in self.members))
        self.pids = {name: pid for name, (pid, _) in zip(self.members, answers)}
        await asyncio.gather(*(self.engine_nodes.note_node(name) for name in self.members if name.role is Role.POLICY))

    # -- who is up -------------------------------------------------------------------------
    def down(self, name: ActorId) -> bool:
        """Whether ``name`` is restarting or gone (it may not hold the fleet's version)."""
        return name in self.recovering or name in self.lost

    def up(self, role: Role | None = None) -> list[ActorId]:
        """The members of ``role`` (all without) up now (not restarting, not lost), index 0 first."""
        return [name for name in self.members if (role is None or name.role is role) and not self.down(name)]

    def engines_up(self) -> list[ActorId]:
        """The engines up now, policy-0 first."""
        return self.up(Role.POLICY)

    def down_now(self) -> dict[str, int]:
        """The members down now: restarting, and lost (not back within their timeout)."""
        return {"actors_restarting": len(self.recovering.keys() - self.lost), "actors_lost": len(self.lost)}

    # -- restarts --------------------------------------------------------------------------
    def recover(self, name: ActorId, died: bool = True) -> None:
        """Wait (in the background) for ``name`` to be restarted; one wait per death. Not once the
        fleet is closed: its actors are being shut down, and a wait started then would outlive
        the event loop (Python prints "Task was destroyed but it is pending" after the job's
        last line). The calls in flight to a member that ``died`` are cancelled: queued behind a
        restart that may never come, they would wait for it. One only slow to answer (busy with a
        long play) keeps them: they may still end well."""
        if name not in self.recovering and not self.closed:
            self.down_at[name] = time.monotonic()
            self.recovering[name] = asyncio.create_task(self._recover(name))
            self.recovering[name].add_done_callback(lambda task: self._ended(name, task))
            if died:
                self.calls.cancel(name)

    @staticmethod
    def _ended(name: ActorId, wait: asyncio.Task) -> None:
        """A wait for a member that failed is said, once: no one else awaits it (Python would print
        its traceback at exit as "Task exception was never retrieved")."""
        if not wait.cancelled() and (err := wait.exception()) is not None:
            log.error("waiting for %s to come back failed: %s: %s", name, type(err).__name__, err)

    async def close(self) -> None:
        """At the run's end, before its actors are shut down: waits for restarts are cancelled."""
        self.closed = True
        waits = list(self.recovering.values())
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)

    async def settle(self) -> None:
        """Return once no member is restarting, but for those already given up on (``lost``): the
        run's end, where every engine up reports its version."""
        while waits := [task for name, task in self.recovering.items() if name not in self.lost]:
            await asyncio.wait(waits, timeout=1.0)

    async def _recover(self, name: ActorId) -> None:
        """Until ``name`` is back and, for an engine, on the fleet's version; an engine that dies
        again while it catches up is waited for again."""
        try:
            # Now: Ray may declare its node dead only a minute later.
            await self.engine_nodes.forget_if_gone(name, self.pids.get(name))
            while True:
                pid, version = await self._back(name)
                await self._seen(name, pid)
                if name.role is not Role.POLICY:
                    return
                await self.engine_nodes.note_node(name)
                try:
                    await self.catch_up(name, version)
                    return
                except RemoteCallError as err:
                    if not err.died:  # up but slow: it serves the version it holds until the next sync
                        log.warning("%s; it catches up at the next sync", err)
                        return
                    log.warning("%s while catching up; waiting for it again", err)
        finally:
            self.recovering.pop(name, None)
            self.down_at.pop(name, None)

    async def _back(self, name: ActorId) -> tuple[int, int]:
        """``name``'s (process id, version) once it answers. Past its role's timeout it is lost: the
        run goes on without it until it answers."""
        role = name.role
        deadline = time.monotonic() + self.timeout_s[role]
        while True:
            asked = time.monotonic()
            try:
                answer = await self._whoami(name, timeout_s=min(REJOIN_CHECK_S, self.timeout_s[role]))
                break
            except RemoteCallError as err:
                await self.engine_nodes.forget_if_gone(name, self.pids.get(name))
                if time.monotonic() > deadline and name not in self.lost:
                    self.lost.add(name)
                    log.error("%s is not back after %.0fs (its node lost and no room to place it again, or its "
                              "max_restarts used up): the run goes on with %d of %d %s actors, and it rejoins "
                              "once Ray starts it again (%s)", name, self.timeout_s[role], len(self.up(role)),
                              self.num[role], role, err)
                await asyncio.sleep(max(0.0, asked + REJOIN_CHECK_S - time.monotonic()))  # one call per check
        if name in self.lost:
            self.lost.discard(name)
            log.warning("%s is back after %.0fs and rejoins the run", name, time.monotonic() - self.down_at[name])
        return answer

    async def _seen(self, name: ActorId, pid: int) -> None:
        """``name`` answered from process ``pid``: a new one means Ray restarted it (and an engine's
        old process is dead, for the weight store)."""
        if pid != self.pids.get(name):
            if name in self.pids:
                await self.engine_nodes.tell_gone(name, self.pids[name])
            self.counters.restarted()
            self.pids[name] = pid
            log.warning("%s restarted (process %d)", name, pid)

    async def roll_call(self) -> None:
        """Each member up says which process it is: a new one is a restart the fleet's calls did not
        meet (a member that died idle and was back before its next call). One that is dead, or
        cannot answer in time (waiting for a node to restart on), is recovered: it is left out of
        the games until it answers."""
        async def ask(name: ActorId) -> None:
            try:
                pid, _ = await self._whoami(name, timeout_s=REJOIN_CHECK_S)
            except RemoteCallError as err:
                self.recover(name, died=err.died)
                return
            if not self.down(name):  # an answer from before a death that a call met meanwhile is old news
                await self._seen(name, pid)

        await asyncio.gather(*(ask(name) for name in self.up()))

    async def _whoami(self, name: ActorId, timeout_s: float | None = None) -> tuple[int, int]:
        return await self.calls.call(name, self.members[name].whoami.remote(),
                                     timeout_s=timeout_s or self.timeout_s[name.role], what="whoami")
