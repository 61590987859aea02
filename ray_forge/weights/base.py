"""What every transport shares: the store's spec, a published version's manifest, errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch

from ray_forge.weights.layout import Bucket

TRANSPORTS = ("shm", "object_store", "nccl", "torchstore")


class WeightSyncError(RuntimeError):
    """A version could not be moved: a peer died, timed out, or the version is gone."""


class TransportUnavailable(WeightSyncError):
    """The chosen transport cannot run in this environment (a package or device is missing)."""


@dataclass(frozen=True, kw_only=True)
class StoreSpec:
    """Everything a process needs to open the store; small and picklable, so it travels to vLLM workers."""

    name: str
    """Unique per run: names the controller actor and the shared-memory folder."""
    transport: str
    """One of :data:`TRANSPORTS` (already resolved; 'auto' is decided at launch)."""
    sender: str = "trainer-0"
    """The process that puts versions; named in every error about a lost version."""
    keep_versions: int = 2
    bucket_bytes: int = 128 * 2**20
    """Tensors travel in buckets of at most this size (a larger tensor travels alone)."""
    dtype: str = ""
    """Floating tensors are converted to this dtype on the way (e.g. 'bfloat16'); '' keeps them."""
    timeout_s: float = 120.0
    """Longest wait for any one put or get."""
    receivers: tuple[str, ...] = ()
    """Named policy actors; only the push transport (nccl) needs them."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown weight transport {self.transport!r}; choose one of {TRANSPORTS}")
        if self.keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        if self.bucket_bytes < 2**16:
            raise ValueError("bucket_bytes must be at least 64 KiB")
        if self.dtype and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"weights dtype {self.dtype!r} is not a torch dtype")

    @property
    def controller_name(self) -> str:
        return f"ray_forge_weights:{self.name}"


@dataclass(frozen=True)
class Manifest:
    """One published version: its layout and where its bytes live (``location`` is per transport)."""

    version: int
    sender: str
    transport: str
    buckets: tuple[Bucket, ...]
    location: Any

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]


class Transport(Protocol):
    """Moves bucket bytes. ``write`` runs in the sender, ``read`` in each receiver (one bucket at
    a time, so a receiver never holds more than about one bucket beyond its model), ``free`` when
    a version is evicted."""

    def write(self, version: int, buckets: list[Bucket], state_dict: dict[str, torch.Tensor]) -> Any: ...

    def read(self, manifest: Manifest, deadline: float) -> Iterator[tuple[Bucket, torch.Tensor]]: ...

    def free(self, manifest: Manifest) -> None: ...
