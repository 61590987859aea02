"""The push transport's rendezvous, kept by the weight store's controller: who takes part in each
push (a *session*), in which generation of process groups, and the ``TCPStore`` they meet at.

Groups are kept from push to push and rebuilt (a new generation) when the engines taking part
change, one restarted, or a push failed. Keys in the store carry their generation, so a rebuilt
group never reads an old one's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ray_forge.weights.base import StoreSpec


@dataclass(frozen=True)
class Session:
    """One push: who takes part, and which generation of groups carries it."""

    generation: int
    version: int
    first_version: int
    """The version this generation's groups were built for; a later push reuses them."""
    host: str
    port: int
    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    workers_per_receiver: int
    closed: bool = False
    """The driver has finished this push; an engine asking for it now missed it."""

    @property
    def group_size(self) -> int:
        return 1 + len(self.receivers) * self.workers_per_receiver

    def group_rank(self, engine: str, worker: int) -> int:
        return 1 + self.receivers.index(engine) * self.workers_per_receiver + worker

    def member_name(self, group_rank: int, sender_rank: int) -> str:
        if group_rank == 0:
            return f"{self.senders[sender_rank]} (sender)"
        engine, worker = divmod(group_rank - 1, self.workers_per_receiver)
        return self.receivers[engine] + (f" worker {worker}" if self.workers_per_receiver > 1 else "")

    def key(self, *parts) -> str:
        return rendezvous_key(self.generation, *parts)

    @property
    def abort_key(self) -> str:
        return rendezvous_key(self.generation, "abort")


def rendezvous_key(generation: int, *parts) -> str:
    """Keys in the rendezvous store, by generation: a rebuilt group never reads an old one's."""
    return "/".join(["push", f"gen{generation}", *map(str, parts)])


class PushSessions:
    """The controller's side: hosts the rendezvous store and decides each push's generation."""

    def __init__(self, host: str) -> None:
        # The server lives as long as the controller; members connect as clients.
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        self.host, self.port = host, self.store.port
        self.generation = 0
        self.current: Session | None = None
        self.stale = True
        self.sessions: dict[int, Session] = {}
        self.opened: dict[int, asyncio.Event] = {}

    def open(self, version: int, receivers: tuple[str, ...], spec: StoreSpec) -> Session:
        senders = spec.senders or (spec.sender,)
        same = (self.current is not None and not self.stale and self.current.receivers == receivers
                and self.current.senders == senders and self.current.workers_per_receiver == spec.workers_per_receiver)
        if not same:
            self.generation += 1
            self.stale = False
        first = self.current.first_version if same else version
        self.current = Session(self.generation, version, first, self.host, self.port, senders, receivers,
                               spec.workers_per_receiver)
        self.sessions[version] = self.current
        self.opened.setdefault(version, asyncio.Event()).set()
        for old in sorted(self.sessions)[:-8]:  # a few recent pushes, for engines asking late
            self.sessions.pop(old)
            self.opened.pop(old, None)
        return self.current

    async def wait_for(self, version: int, timeout_s: float) -> Session | None:
        if version not in self.sessions:
            try:
                await asyncio.wait_for(self.opened.setdefault(version, asyncio.Event()).wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                return None
        return self.sessions.get(version)

    def fail(self, generation: int, reason: str) -> None:
        if self.current is not None and self.current.generation == generation:
            self.stale = True
        key = rendezvous_key(generation, "abort")
        if not self.store.check([key]):
            self.store.set(key, reason)

    def close(self, version: int) -> None:
        if version in self.sessions:
            self.sessions[version] = dataclasses.replace(self.sessions[version], closed=True)

    def member_restarted(self, name: str) -> None:
        if self.current is not None and name in self.current.receivers:
            self.stale = True
