"""What every transport shares: the store's spec, a published version's manifest, errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch

from ray_forge.config import check_engine_transport
from ray_forge import identity
from ray_forge.weights.layout import Bucket

TRANSPORTS = ("shm", "object_store", "nixl", "collective", "torchstore")
PUSH_TRANSPORTS = ("collective",)
"""Transports where the sender streams into live receivers: the trainer's put and the engines'
loads must run at the same time, and nothing is stored for a later reader."""
FREED_BY_WRITER = ("shm", "torchstore")
"""Transports whose evicted parts only the rank that wrote them can free (files on its node, its
keys). The others free a part when its last reference goes, which the controller drops at once."""


class WeightSyncError(RuntimeError):
    """A version could not be moved: a peer died, timed out, or the version is gone."""


class TransportUnavailable(WeightSyncError):
    """The chosen transport cannot run in this environment (a package or device is missing)."""


class SyncNotOpened(WeightSyncError):
    """A trainer rank published a version that no driver opened a sync for, over a transport that
    streams into live engines: the driver did not run the trainer's publish and the engines' sync
    together (a bug in the driver, not a fault)."""


class MixedWeights(WeightSyncError):
    """A load failed after it had begun to overwrite the engine's weights: the engine now holds
    parts of two versions until a later load completes."""


@dataclass(frozen=True, kw_only=True)
class StoreSpec:
    """Everything a process needs to open the store; small and picklable, so it travels to vLLM workers."""

    name: str
    """Unique per run: names the controller actor and the shared-memory folder."""
    transport: str
    """One of :data:`TRANSPORTS` (already resolved; 'auto' is decided at launch)."""
    sender: str = str(identity.trainer(0))
    """The process that puts versions when one process puts the whole state dict; named in errors."""
    senders: tuple[str, ...] = ()
    """The trainer ranks that each put their own shards, in rank order; named in errors about a
    missing part. Empty: one sender, ``sender``."""
    keep_versions: int = 2
    bucket_bytes: int = 128 * 2**20
    """Tensors travel in buckets of at most this size (a larger tensor travels alone)."""
    dtype: str = ""
    """Floating tensors are converted to this dtype on the way (e.g. 'bfloat16'); '' keeps them."""
    timeout_s: float = 120.0
    """Longest wait for any one put or get (for a push: the whole transfer)."""
    receivers: tuple[str, ...] = ()
    """Named policy actors, in order; the push transport (collective) gives each its group ranks."""
    workers_per_receiver: int = 1
    """vLLM workers per policy engine (its tensor-parallel size); each is a member of a push group."""

    def __post_init__(self) -> None:
        if self.transport == "nccl":
            raise ValueError("weights.transport 'nccl' (vLLM's weight-transfer API) was replaced by 'collective', "
                             "which runs over NCCL on GPUs and gloo on CPUs")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown weight transport {self.transport!r}; choose one of {TRANSPORTS}")
        if self.keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        if self.bucket_bytes < 2**16:
            raise ValueError("bucket_bytes must be at least 64 KiB")
        if self.workers_per_receiver < 1:
            raise ValueError("workers_per_receiver must be >= 1")
        check_engine_transport(self.transport, self.workers_per_receiver)
        if self.dtype and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"weights dtype {self.dtype!r} is not a torch dtype")

    @property
    def controller_name(self) -> str:
        return controller_name(self.name)

    @property
    def pushes(self) -> bool:
        return self.transport in PUSH_TRANSPORTS

    @property
    def freed_by_writer(self) -> bool:
        return self.transport in FREED_BY_WRITER

    def sender_name(self, rank: int, num_ranks: int = 1) -> str:
        if rank < len(self.senders):
            return self.senders[rank]
        return self.sender if num_ranks == 1 else f"trainer rank {rank}"


@dataclass(frozen=True)
class Part:
    """One sender's share of a version: its buckets and where their bytes live (``location`` is
    per transport). A version put by one process has one part."""

    version: int
    sender: str
    transport: str
    buckets: tuple[Bucket, ...]
    location: Any
    rank: int = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True)
class Manifest:
    """A published version: every sender's part, in rank order. It is published only once every
    rank has put its part."""

    version: int
    parts: tuple[Part, ...]

    @property
    def sender(self) -> str:
        return ", ".join(p.sender for p in self.parts)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return tuple(b for p in self.parts for b in p.buckets)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def without_locations(self) -> "Manifest":
        """The layout alone: holding it keeps none of the version's bytes alive (object-store
        buckets, a NIXL sender's arena)."""
        return Manifest(self.version, tuple(Part(p.version, p.sender, p.transport, p.buckets, None, p.rank)
                                            for p in self.parts))

    def names(self) -> list[str]:
        """Every tensor of the version once, in group order."""
        seen: dict[str, None] = {}
        for _, bucket in self.in_group_order():
            seen.update((t.name, None) for t in bucket.tensors)
        return list(seen)

    def in_group_order(self) -> Iterator[tuple[Part, Bucket]]:
        """Every part's bucket of group 0, then of group 1, ...: the order a receiver reads them in,
        so that it completes one group of whole tensors before it starts the next."""
        held = [{b.index: b for b in part.buckets} for part in self.parts]
        for group in sorted(set().union(*held)):
            for part, buckets in zip(self.parts, held):
                if group in buckets:
                    yield part, buckets[group]


def controller_name(store_name: str) -> str:
    """The named actor that keeps a store's versions (found again by a restarted engine)."""
    return f"ray_forge_weights:{store_name}"


def version_key(version: int) -> str:
    """How every transport names a version (a folder, a key prefix, a rendezvous key)."""
    return f"policy_ver_{version:010d}"


class Transport(Protocol):
    """Moves bucket bytes; one per process and store. Every transport has the same shape:

    - ``put`` runs in a trainer rank: it moves the rank's buckets and publishes its part (through
      ``publish``) once receivers may read it: after writing them for a transport that stores
      them, before streaming them for one that pushes into live receivers;
    - ``fetch`` runs in a receiver, off the engine's step loop: it waits for the version and brings
      its bytes into this process where the transport can hold them (NIXL's registered buffers, a
      push's staging), so that the load pauses generation only for the copy into the engine.
      None when this process is not one the version goes to (a push it was not a member of);
    - ``read`` yields a part's buckets, one at a time, from what ``fetch`` brought in or from
      where they are stored (so a receiver holds about one bucket beyond its model);
    - ``free`` releases an evicted part (in the process that wrote it).
    """

    def put(self, part: Part, tensors: Mapping[str, torch.Tensor], publish: Callable[[Part], None]) -> Part: ...

    def fetch(self, version: int, member: str, worker: int, deadline: float) -> Manifest | None: ...

    def read(self, part: Part, deadline: float) -> Iterator[tuple[Bucket, torch.Tensor]]: ...

    def holds(self, manifest: Manifest) -> bool:
        """Whether this process holds the version's bytes (fetched here and not replaced since)."""
        ...

    def route(self) -> str:
        """How the bytes reached this process, in words, for the run's log and summary."""
        ...

    def free(self, part: Part) -> None: ...

    def destroy(self) -> None:
        """Release what this process holds (shared-memory folders it wrote, buffers, push groups)."""
        return None
