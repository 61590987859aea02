"""The store's controller actor: which versions exist and where they live (TorchStore's role).

A version is put in parts, one per trainer rank; it is published (receivers may read it) only
once every rank's part is in. For the push transport it also opens each push: who takes part,
in which process group generation, and the rendezvous store they meet at.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import ray

from ray_forge.weights.base import Manifest, Part, StoreSpec

log = logging.getLogger(__name__)


class WeightStoreController:
    """Holds the manifest of each live version. For the object-store transport the manifests hold
    the bucket refs, so dropping a manifest here is what frees that version's memory."""

    def __init__(self) -> None:
        self.manifests: dict[int, Manifest] = {}
        self.partial: dict[int, dict[int, Part]] = {}
        """Versions some ranks have put their part of, by rank; published once all are in."""
        self.num_parts: dict[int, int] = {}
        self.published: dict[int, asyncio.Event] = {}
        self.to_free: dict[int, list[Part]] = defaultdict(list)
        """Evicted parts by the rank that wrote them: only that rank can free them (shared memory
        lives on its node), so each rank collects its own at its next put."""
        self.spec: StoreSpec | None = None
        self.pushes = None  # the push transport's sessions, made on first use

    def _event(self, version: int) -> asyncio.Event:
        return self.published.setdefault(version, asyncio.Event())

    async def put_part(self, part: Part, num_parts: int, keep_versions: int,
                       spec: StoreSpec | None = None) -> list[Part]:
        """Record one rank's part; the version is published when all ``num_parts`` are in.
        Returns the parts this rank wrote that have since been evicted, for it to free."""
        self.spec = spec or self.spec
        parts = self.partial.setdefault(part.version, {})
        parts[part.rank] = part
        self.num_parts[part.version] = num_parts
        if len(parts) == num_parts:
            del self.partial[part.version]
            self.manifests[part.version] = Manifest(part.version, tuple(parts[r] for r in sorted(parts)))
            self._event(part.version).set()
            self._evict(keep_versions)
        return self.to_free.pop(part.rank, [])

    def _evict(self, keep_versions: int) -> None:
        """Keep the newest ``keep_versions``; drop unfinished versions older than the newest, which
        can no longer be completed (a rank died or moved on), waking their waiters."""
        newest = max(self.manifests)
        for version in sorted(self.manifests)[:-keep_versions]:
            self._drop(version, self.manifests.pop(version).parts)
        for version in [v for v in self.partial if v < newest]:
            self._drop(version, tuple(self.partial.pop(version).values()))

    def _drop(self, version: int, parts: tuple[Part, ...]) -> None:
        for part in parts:
            self.to_free[part.rank].append(part)
        event = self.published.pop(version, None)
        if event is not None:
            event.set()  # a waiter wakes, finds no manifest, and reports the version gone

    async def manifest(self, version: int, timeout_s: float) -> Manifest | None:
        """The version's manifest, waiting up to ``timeout_s`` for every part; None if it was not
        published in time or was already evicted."""
        if version not in self.manifests and self.manifests and version < max(self.manifests):
            return None  # older than every live version: evicted, it will never come back
        try:
            await asyncio.wait_for(self._event(version).wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            return None
        return self.manifests.get(version)

    async def missing_parts(self, version: int) -> list[int] | None:
        """The ranks whose part of an unpublished version has not arrived (every rank if none has,
        as far as known); None when the version is published."""
        if version in self.manifests:
            return None
        parts = self.partial.get(version, {})
        num_parts = self.num_parts.get(version) or (self.spec and len(self.spec.senders)) or 1
        return [r for r in range(num_parts) if r not in parts]

    async def latest(self) -> tuple[StoreSpec, int] | None:
        """The store's spec and newest version, for a receiver that restarted and must catch up."""
        if not self.manifests or self.spec is None:
            return None
        return self.spec, max(self.manifests)

    async def versions(self) -> list[int]:
        return sorted(self.manifests)

    async def delete(self, version: int) -> Manifest | None:
        self.published.pop(version, None)
        self.num_parts.pop(version, None)
        return self.manifests.pop(version, None)

    # -- pushes (collective transport) --------------------------------------------------------
    def _sessions(self):
        from ray_forge.weights.collective import PushSessions

        if self.pushes is None:
            self.pushes = PushSessions(ray.util.get_node_ip_address())
        return self.pushes

    async def open_push(self, version: int, receivers: tuple[str, ...], spec: StoreSpec):
        """Start the push of ``version`` to ``receivers`` (the live engines); returns its session."""
        self.spec = spec
        return self._sessions().open(version, receivers, spec)

    async def push_session(self, version: int, timeout_s: float):
        """The session of ``version``'s push, waiting up to ``timeout_s`` for it to be opened."""
        return await self._sessions().wait_for(version, timeout_s)

    async def push_failed(self, generation: int, reason: str) -> None:
        """Someone in a push failed: wake every member still waiting, and rebuild the groups next time."""
        self._sessions().fail(generation, reason)

    async def close_push(self, version: int) -> None:
        self._sessions().close(version)

    async def receiver_restarted(self, name: str) -> None:
        """An engine came back in a new process: its old group ranks are dead, so rebuild."""
        self._sessions().member_restarted(name)


ControllerActor = ray.remote(num_cpus=0)(WeightStoreController)
