"""Where each engine runs, and the engines whose node was lost. Such an engine takes its process
with it: the weight store is told (``receiver_gone``) as soon as the engine goes down, so no version
waits for a read that will never end. Only a death that is certain is told: a member merely
unreachable may still be reading."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ray_forge.cluster import nodes
from ray_forge.identity import ActorId, Role
from ray_forge.remote import RemoteCallError
from ray_forge.run.fleet.calls import Calls
from ray_forge.weights import StoreSpec, WeightSyncError
from ray_forge.weights.controller import ControllerClient

log = logging.getLogger(__name__)


class EngineNodes:
    def __init__(self, members: dict[ActorId, object], calls: Calls, *, timeout_s: float,
                 store: Callable[[], StoreSpec | None]) -> None:
        self.members, self.calls, self.timeout_s = members, calls, timeout_s
        self.store = store
        """The weight store's spec once a version was synced (None before)."""
        self.of: dict[ActorId, str] = {}
        """The node each engine's process runs on: when it dies, whether its node went with it."""
        self.gone: set[tuple[ActorId, int]] = set()
        """Engine processes the weight store was told are dead."""

    async def note_node(self, name: ActorId) -> None:
        """Where engine ``name``'s process runs now (asked while it is up)."""
        try:
            self.of[name] = await self.calls.call(name, self.members[name].node_id.remote(),
                                                  timeout_s=self.timeout_s, what="node_id")
        except RemoteCallError as err:  # it went down again: its node is asked when it is back
            log.warning("%s", err)

    async def forget_if_gone(self, name: ActorId, pid: int | None) -> None:
        """An engine (process ``pid``) that is down, on a node that is lost, is dead: tell the weight
        store. Asked when it goes down (a raylet that refuses connections is gone) and at each
        rejoin check, as Ray may declare the node dead only later."""
        if name.role is Role.POLICY and (name, pid) not in self.gone and name in self.of:
            if await asyncio.to_thread(nodes.lost, self.of[name]):
                await self.tell_gone(name, pid)

    async def tell_gone(self, name: ActorId, pid: int) -> None:
        """The weight store stops counting engine ``name``'s process ``pid`` as a reader."""
        if name.role is not Role.POLICY or (name, pid) in self.gone or (spec := self.store()) is None:
            return  # before the first sync nothing was published for it to read
        self.gone.add((name, pid))
        try:
            await ControllerClient(spec).receiver_gone(str(name), pid)
        except (RemoteCallError, WeightSyncError) as err:  # the store is gone too (the run is ending)
            log.warning("the weight store was not told that %s (process %d) is dead: %s", name, pid, err)
