"""The store's controller: which versions exist and where they live (TorchStore's role), and the
client every other process talks to it through.

A version is put in parts, one per trainer rank; it is published (receivers may read it) only
once every rank's part is in. For the push transport it also opens each push: who takes part,
in which process group generation, and the rendezvous store they meet at (``rendezvous.py``).
Every call of the client has a timeout, and a missing version is explained by who did not put it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import ray

from ray_forge.weights.base import Manifest, Part, StoreSpec, WeightSyncError, controller_name
from ray_forge.weights.rendezvous import PushSessions, Session

log = logging.getLogger(__name__)

Reader = tuple[str, int]
"""A receiver process that reads versions: its name (the engine's) and process id."""

READERS_KEPT = 1000
"""Versions after which the controller forgets who read one. A NIXL sender rewrites a version's
buffers within a few versions, or holds them while Ray counts refs to them: a reader that gave no
name and held a version this long would see it rewritten."""


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
        self.reading: dict[int, set[Reader]] = {}
        """By version: the named receivers handed its manifest that have not said they are done."""
        self.unnamed: set[int] = set()
        """Versions whose manifest went to a receiver that gave no name: only Ray knows when it is done."""
        self.gone: set[Reader] = set()
        """Receiver processes the run has found dead: their reads will never end, nor need the bytes."""

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
        can no longer be completed (a rank died or moved on), waking their waiters. Who read a
        version is forgotten ``READERS_KEPT`` versions later (no sender keeps its buffers that long)."""
        newest = max(self.manifests)
        for version in sorted(self.manifests)[:-keep_versions]:
            self._drop(version, self.manifests.pop(version).parts)
        for version in [v for v in self.partial if v < newest]:
            self._drop(version, tuple(self.partial.pop(version).values()))
        for version in [v for v in self.reading if v < newest - READERS_KEPT]:
            del self.reading[version]
        self.unnamed = {v for v in self.unnamed if v >= newest - READERS_KEPT}

    def _drop(self, version: int, parts: tuple[Part, ...]) -> None:
        if self.spec is None or self.spec.freed_by_writer:
            for part in parts:
                self.to_free[part.rank].append(part)
        # Otherwise dropping the parts drops the last references to their bytes (object store
        # buckets, a NIXL sender's arena), which frees them now, not at the rank's next put.
        event = self.published.pop(version, None)
        if event is not None:
            event.set()  # a waiter wakes, finds no manifest, and reports the version gone

    async def manifest(self, version: int, timeout_s: float, reader: Reader | None = None) -> Manifest | None:
        """The version's manifest, waiting up to ``timeout_s`` for every part; None if it was not
        published in time or was already evicted. ``reader`` (a receiver's name and process) says
        when it is done reading (``read_done``); a manifest given to no named reader is done only
        when Ray says every ref to it is gone."""
        if version not in self.manifests and self.manifests and version < max(self.manifests):
            return None  # older than every live version: evicted, it will never come back
        try:
            await asyncio.wait_for(self._event(version).wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            return None
        found = self.manifests.get(version)
        if found is not None:
            if reader is None:
                self.unnamed.add(version)
            else:
                self.reading.setdefault(version, set()).add(reader)
        return found

    async def read_done(self, version: int, reader: Reader) -> None:
        """``reader`` holds its own copy of the version: it needs the sender's bytes no more."""
        readers = self.reading.get(version, set())
        readers.discard(reader)
        if not readers:
            self.reading.pop(version, None)

    async def receiver_gone(self, name: str, pid: int) -> None:
        """Process ``pid`` of receiver ``name`` is dead (its node lost, or Ray restarted it)."""
        self.gone.add((name, pid))

    async def reclaimable(self, versions: list[int]) -> dict[int, list[Reader]]:
        """Of a sender's ``versions``, those whose bytes no one will read again: evicted, and every
        named reader done or gone (an unnamed one: never). Each with the gone readers whose refs
        Ray may still count: a receiver lost with its node stays a borrower in Ray's count, so
        its version would never be freed."""
        free = {}
        for version in versions:
            readers = self.reading.get(version, set())
            if version in self.manifests or version in self.partial or version in self.unnamed \
                    or not readers <= self.gone:
                continue
            free[version] = sorted(readers)
        return free

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
    def _sessions(self) -> PushSessions:
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


CONTROLLER_TIMEOUT_S = 60.0


class ControllerClient:
    """How every process talks to a store's controller; cheap to make, and picklable by its spec."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self._handle = None

    def start(self) -> None:
        """Start the controller (owned by the calling process, normally the driver)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Keep this handle: Ray stops an actor once its creator's handles are gone. On the creator's
        # node (the driver's): anywhere else, losing that node would take every version's bookkeeping.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._handle = ControllerActor.options(name=controller_name(self.spec.name), get_if_exists=True,
                                               scheduling_strategy=here).remote()
        self.ask(self._handle.versions.remote(), "start-up", timeout_s=max(CONTROLLER_TIMEOUT_S, self.spec.timeout_s))

    @property
    def handle(self):
        if self._handle is None:
            try:
                self._handle = ray.get_actor(controller_name(self.spec.name))
            except ValueError:
                raise WeightSyncError(f"weight store {self.spec.name!r} has no controller; "
                                      "create it with WeightStore.create(spec) first") from None
        return self._handle

    def ask(self, ref, what: str, timeout_s: float | None = None):
        """The controller's answer. Its bookkeeping calls get at least CONTROLLER_TIMEOUT_S whatever
        the transfer timeout: the first ref of a direct transport (nixl) that reaches it starts Ray's
        transport manager there, which takes seconds."""
        try:
            return ray.get(ref, timeout=timeout_s or max(self.spec.timeout_s, CONTROLLER_TIMEOUT_S))
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncError(f"weight store controller did not answer {what} in time") from None
        except ray.exceptions.RayActorError as err:
            raise WeightSyncError(f"weight store controller died during {what}") from err

    async def ask_async(self, method: str, *args):
        """A controller call from the driver's event loop (opening, failing and closing a push)."""
        from ray_forge.remote import call

        return await call(getattr(self.handle, method).remote(*args), timeout_s=CONTROLLER_TIMEOUT_S,
                          what=f"weight store.{method}")

    # -- versions ------------------------------------------------------------------------------
    def put_part(self, part: Part, num_ranks: int) -> list[Part]:
        """Record a rank's part; returns the parts of this rank evicted since, for it to free."""
        return self.ask(self.handle.put_part.remote(part, num_ranks, self.spec.keep_versions, self.spec),
                        f"put_part({part.version}, rank {part.rank})")

    def manifest(self, version: int, deadline: float, reader: Reader | None = None) -> Manifest:
        """The version's manifest, waiting until ``deadline`` for every rank's part; an error that
        says who did not put it (or that it was evicted) otherwise. A named ``reader`` calls
        ``read_done`` once it no longer needs the sender's bytes."""
        wait_s = max(0.0, deadline - time.monotonic())
        found = self.ask(self.handle.manifest.remote(version, wait_s, reader), f"manifest({version})", wait_s + 10)
        if found is None:
            raise WeightSyncError(f"weights version {version} from {self._senders()} are not available: "
                                  f"{self._why_missing(version)}; live versions {self.versions()}")
        return found

    def _senders(self) -> str:
        return ", ".join(self.spec.senders) or self.spec.sender

    def _why_missing(self, version: int) -> str:
        live = self.versions()
        missing = self.ask(self.handle.missing_parts.remote(version), f"missing_parts({version})")
        if (live and version < live[0]) or missing is None:
            return "it was evicted"
        num_ranks = max(len(self.spec.senders), 1 + max(missing, default=0))
        names = ", ".join(self.spec.sender_name(r, num_ranks) for r in missing)
        did = "did not publish it" if len(missing) == num_ranks else "did not put its part"
        return f"{names} {did} within {self.spec.timeout_s:.0f}s (is the sender alive?)"

    def versions(self) -> list[int]:
        return self.ask(self.handle.versions.remote(), "versions()")

    def read_done(self, version: int, reader: Reader) -> None:
        """Said without waiting for an answer: until it arrives the sender asks Ray instead."""
        self.handle.read_done.remote(version, reader)

    def reclaimable(self, versions: list[int]) -> dict[int, list[Reader]]:
        return self.ask(self.handle.reclaimable.remote(versions), "reclaimable()")

    async def receiver_gone(self, name: str, pid: int) -> None:
        """From the driver's event loop (the fleet found the receiver's process dead)."""
        await self.ask_async("receiver_gone", name, pid)

    def delete(self, version: int) -> Manifest | None:
        return self.ask(self.handle.delete.remote(version), f"delete({version})")

    def latest(self, timeout_s: float) -> tuple[StoreSpec, int] | None:
        return self.ask(self.handle.latest.remote(), "latest()", timeout_s)

    # -- pushes --------------------------------------------------------------------------------
    def push_session(self, version: int, deadline: float) -> Session | None:
        wait_s = max(0.0, deadline - time.monotonic())
        return self.ask(self.handle.push_session.remote(version, wait_s), f"push_session({version})", wait_s + 10)

    def push_failed(self, generation: int, reason: str) -> None:
        self.ask(self.handle.push_failed.remote(generation, reason[:2000]), "push_failed", 30)

    def receiver_restarted(self, name: str, timeout_s: float) -> None:
        self.ask(self.handle.receiver_restarted.remote(name), "receiver_restarted", timeout_s)

    def kill(self) -> None:
        ray.kill(self.handle, no_restart=True)
