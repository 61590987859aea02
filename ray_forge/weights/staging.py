"""The bytes of one version that a receiving process holds between fetching it and loading it.

A policy actor fetches a version off the engine's step loop (NIXL reads it into registered
buffers, a push receives it), and the engine's worker, in the same process, loads it on the step
loop: both reach the same staging, found by the store's name. One version at a time; buffers are
kept from version to version while the layout stays the same (every step after the first).
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator

import torch

from ray_forge.weights.base import Manifest, Part, WeightSyncError
from ray_forge.weights.layout import Bucket

Allocate = Callable[[int, torch.device], torch.Tensor]
Release = Callable[[torch.Tensor], None]


def receiving_device() -> torch.device:
    """Where a receiver keeps what it fetched: its GPU when it has one, else host memory."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Staging:
    """One buffer (an *arena*) for a whole version, with a view per (sender rank, bucket), and the
    version it holds (None while being filled). One allocation: a transport that registers
    memory (NIXL) registers it once, and a layout that stays the same keeps it."""

    def __init__(self, allocate: Allocate, release: Release | None = None) -> None:
        self._allocate, self._release = allocate, release
        self.arena: torch.Tensor | None = None
        self.layout: tuple[tuple[tuple[int, int], int], ...] = ()
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.version: int | None = None

    def prepare(self, manifest: Manifest, device: torch.device) -> dict[tuple[int, int], torch.Tensor]:
        """A view for every bucket of ``manifest``; the version held is unknown until :meth:`mark`
        (a fetch that fails part-way leaves none)."""
        self.version = None
        layout = tuple(((p.rank, b.index), b.nbytes) for p in manifest.parts for b in p.buckets)
        if layout != self.layout or self.arena is None or self.arena.device != device:
            self.clear()
            self.arena, self.buffers = arena(layout, self._allocate, device)
            self.layout = layout
        return self.buffers

    def mark(self, version: int) -> None:
        self.version = version

    def holds(self, part: Part) -> bool:
        return self.version == part.version and all((part.rank, b.index) in self.buffers for b in part.buckets)

    def read(self, part: Part) -> Iterator[tuple[Bucket, torch.Tensor]]:
        if not self.holds(part):
            raise WeightSyncError(f"weights version {part.version} from {part.sender} were not fetched into this "
                                  f"process (it holds version {self.version})")
        for bucket in part.buckets:
            yield bucket, self.buffers[(part.rank, bucket.index)]

    def clear(self) -> None:
        if self.arena is not None and self._release is not None:
            self._release(self.arena)
        self.arena, self.layout, self.buffers, self.version = None, (), {}, None


def arena(layout, allocate: Allocate, device: torch.device) -> tuple[torch.Tensor, dict]:
    """One uint8 buffer for every (key, nbytes) of ``layout``, and a view of it per key (each
    starting on a 64-byte boundary, so any dtype can be viewed in it)."""
    offsets, total = {}, 0
    for key, nbytes in layout:
        offsets[key] = total
        total += -(-nbytes // 64) * 64
    buffer = allocate(max(total, 64), device)
    return buffer, {key: buffer[offsets[key]:offsets[key] + nbytes] for key, nbytes in layout}


_STAGINGS: dict[str, Staging] = {}
_LOCK = threading.Lock()


def staging_for(store_name: str, allocate: Allocate, release: Release | None = None) -> Staging:
    """This process's staging for a store (made on first use)."""
    with _LOCK:
        if store_name not in _STAGINGS:
            _STAGINGS[store_name] = Staging(allocate, release)
        return _STAGINGS[store_name]


def drop_staging(store_name: str) -> None:
    with _LOCK:
        staging = _STAGINGS.pop(store_name, None)
    if staging is not None:
        staging.clear()
