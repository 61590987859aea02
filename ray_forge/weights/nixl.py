"""RDMA-capable transport: Ray Direct Transport (RDT) over NVIDIA's NIXL.

Each trainer rank packs its buckets into one buffer (an *arena*) it allocated and registered
with NIXL once, and publishes its part as one RDT object, the list of its buckets' views
(``ray.put(..., _tensor_transport="nixl")``): the bytes stay in the sender's memory, and only the
ref travels, in the manifest. A receiver points the ref at views of an arena of its own,
registered once too (``set_target_for_ref``), and ``ray.get`` makes NIXL read every bucket
straight into them in one transfer: over InfiniBand or RoCE where the NICs exist, over UCX's
``tcp`` and ``cma`` (cross-memory attach) on a machine without them. On a GPU the same code moves
CUDA tensors. One object per part, not per bucket: each RDT object costs a round of metadata
between the two processes, which small buckets would pay hundreds of times.

A receiver reads every bucket of a version when it *fetches* it, which a policy engine does off
its step loop: generation goes on during the transfer and pauses only for the copy from these
buffers into the engine. A transfer that fails (a dead sender: Ray reports its owner died) fails
before the engine has loaded anything.

The sender keeps ``keep_versions + 2`` arenas and writes into one again only once Ray says
every ref to its last version is gone (``wait_tensor_freed``): the controller drops a
version's refs when it evicts it, and a receiver drops its own when it has read them. Two sets
beyond the live versions, because with several ranks an evicted part waits in the controller
until its rank's next put collects it, and that put writes first.

Ray caches NIXL registrations by address: a buffer is deregistered before it is dropped, or a
later buffer allocated at the same address would inherit a registration of the wrong size.
NIXL's agent is not thread-safe by default, and the policy actor serves calls from several
threads: every NIXL call of a process goes through one lock.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping

import ray
import torch

from ray_forge.weights.base import Manifest, Part, StoreSpec, TransportUnavailable, WeightSyncError
from ray_forge.weights.controller import ControllerClient
from ray_forge.weights.layout import Bucket, pack_into
from ray_forge.weights.staging import arena, drop_staging, receiving_device, staging_for
from ray_forge.weights.stored import StoredTransport

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
"""One per process: NIXL's agent is not thread-safe (see the module's docstring)."""


_UCX_INFO_DIR: Path | None = None
"""Where UCX writes the protocols it selects for reads in this process (see ``watch_ucx``)."""
_UCX_SAID: list[str] | None = None


def watch_ucx() -> None:
    """Before this process's NIXL agent starts (UCX reads its settings then), ask UCX to write the
    protocols it selects for remote reads, the way buckets travel, to a folder of this process,
    unless the user set UCX_PROTO_INFO themselves. ``ucx_transports`` reads them back."""
    global _UCX_INFO_DIR
    if _UCX_INFO_DIR is None and "UCX_PROTO_INFO" not in os.environ:
        _UCX_INFO_DIR = Path(tempfile.mkdtemp(prefix=f"ray_forge-ucx-{os.getpid()}-"))
        atexit.register(shutil.rmtree, _UCX_INFO_DIR, ignore_errors=True)
        os.environ["UCX_PROTO_INFO"] = "*get*"
        os.environ["UCX_PROTO_INFO_DIR"] = str(_UCX_INFO_DIR)


def ucx_transports() -> list[str]:
    """The UCX transports selected in this process to read remote memory so far, e.g.
    ``['cma/memory (intra-node)']`` or ``['rc_mlx5/mlx5_0:1 (inter-node)']``; empty when unknown."""
    if _UCX_SAID is not None:
        return _UCX_SAID
    if _UCX_INFO_DIR is None:
        return []
    found = set()
    for path in _UCX_INFO_DIR.glob("*_get_*.dot"):
        where = "intra-node" if "_intra_node_" in path.name else "inter-node"
        match = re.search(r'node0 \[label="[^"\\]*\\n([^"]+)"', path.read_text(errors="replace"))
        if match:
            found.add(f"{match.group(1)} ({where})")
    return sorted(found)


def _say_ucx_transports() -> None:
    """Log, once per process and once known, which UCX transports carried the buckets."""
    global _UCX_SAID
    if _UCX_SAID is None and (found := ucx_transports()):
        _UCX_SAID = found
        log.info("weights over NIXL: UCX reads remote memory over %s", ", ".join(found))


def import_rdt():
    """Ray's RDT functions, after checking that NIXL itself imports (Ray would fail later, in a transfer)."""
    watch_ucx()
    try:
        import nixl._api  # noqa: F401  the meta package's shim loads the cu12 build's bindings
        from ray.experimental import (deregister_nixl_memory, register_nixl_memory, set_target_for_ref,
                                      wait_tensor_freed)
    except Exception as err:
        raise TransportUnavailable(
            f"weights.transport=nixl needs NIXL's Python package, which failed to import "
            f"({err.__class__.__name__}: {err}). Install nixl-cu12==1.5.1, then nixl==1.5.1 with --no-deps "
            "(`make venv` does both), or choose weights.transport=shm or object_store") from err
    return register_nixl_memory, deregister_nixl_memory, set_target_for_ref, wait_tensor_freed


class _Slot:
    """One arena of send buffers: a view per bucket index, as last put."""

    def __init__(self) -> None:
        self.arena: torch.Tensor | None = None
        self.layout: tuple[tuple[int, int], ...] = ()
        self.views: dict[int, torch.Tensor] = {}


class _Arenas:
    """A sending process's arenas for one store, used in turn. Kept per process, not per client:
    a second client of the same store in this process (a fresh ``WeightStore``) reuses them, so no
    registered memory is dropped while Ray still caches its registration."""

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.next = 0


_SENDING: dict[str, _Arenas] = {}


class NixlTransport(StoredTransport):
    def __init__(self, spec: StoreSpec, client: ControllerClient) -> None:
        super().__init__(spec, client)
        self._register, self._deregister, self._set_target, self._wait_freed = import_rdt()

    # -- sender --------------------------------------------------------------------------------
    def write(self, version: int, rank: int, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor]):
        if not buckets:
            return None  # this rank holds no rows of any tensor: nothing to read
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        slot = self._free_slot(version, buckets, device)
        views = [slot.views[bucket.index] for bucket in buckets]
        with _LOCK:
            for bucket, view in zip(buckets, views):
                pack_into(bucket, tensors, view)
            ref = ray.put(views, _tensor_transport="nixl")
        return ref

    def _free_slot(self, version: int, buckets: list[Bucket], device: torch.device) -> _Slot:
        """The next arena, once no ref to what it last held is alive (a fresh one while fewer than
        ``keep_versions + 2`` exist), laid out for ``buckets``."""
        arenas = _SENDING.setdefault(self.spec.name, _Arenas())
        if len(arenas.slots) < self.spec.keep_versions + 2:
            arenas.slots.append(_Slot())
        slot = arenas.slots[arenas.next]
        arenas.next = (arenas.next + 1) % (self.spec.keep_versions + 2)
        deadline = time.monotonic() + self.spec.timeout_s
        for view in slot.views.values():  # the views that were put: Ray tracks the objects themselves
            try:
                self._wait_freed(view, timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise WeightSyncError(
                    f"weights version {version}: the buffers of an older version are still referenced after "
                    f"{self.spec.timeout_s:.0f}s (a receiver or the controller holds its refs), so they cannot "
                    "be written again") from None
        layout = tuple((b.index, b.nbytes) for b in buckets)
        if layout != slot.layout or slot.arena is None or slot.arena.device != device:
            if slot.arena is not None:
                self._release(slot.arena)  # the layout changed: this arena no longer fits
            slot.arena, slot.views = arena(layout, self._registered, device)
            slot.layout = layout
        return slot

    def _registered(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        with _LOCK:
            self._register(buffer)  # once: NIXL caches registrations by address
        return buffer

    def _release(self, buffer: torch.Tensor) -> None:
        with _LOCK:
            self._deregister(buffer)

    # -- receiver ------------------------------------------------------------------------------
    def fetch(self, version: int, member: str, worker: int, deadline: float) -> Manifest:
        """Every bucket of ``version`` into this process's registered arena: one transfer per part."""
        manifest = super().fetch(version, member, worker, deadline)
        staging = staging_for(self.spec.name, self._registered, self._release)
        buffers = staging.prepare(manifest, receiving_device())
        for part in manifest.parts:
            if part.buckets:
                self._receive(part, [buffers[(part.rank, b.index)] for b in part.buckets], deadline)
        staging.mark(version)
        _say_ucx_transports()
        return manifest

    def _receive(self, part: Part, targets: list[torch.Tensor], deadline: float) -> None:
        what = f"weights version {part.version} from {part.sender} ({len(targets)} buckets)"
        with _LOCK:
            try:
                self._set_target(part.location, targets)
                got = ray.get(part.location, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise WeightSyncError(f"{what} did not arrive within the {self.spec.timeout_s:.0f}s timeout") from None
            except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError) as err:
                raise WeightSyncError(f"{what} is lost: {part.sender} died ({err.__class__.__name__})") from None
            except ray.exceptions.RayError as err:
                raise WeightSyncError(f"{what} failed over NIXL (did {part.sender} die?): {err.__class__.__name__}: "
                                      f"{str(err).splitlines()[0] if str(err) else ''}") from None
        if any(g.data_ptr() != t.data_ptr() for g, t in zip(got, targets)):  # Ray allocated: ours were refused
            raise WeightSyncError(f"{what} was not received into its registered buffers")

    def read(self, part: Part, deadline: float) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """The buckets this process fetched (in the policy actor, before the engine's worker loads)."""
        yield from staging_for(self.spec.name, self._registered, self._release).read(part)

    def destroy(self) -> None:
        for slot in _SENDING.pop(self.spec.name, _Arenas()).slots:
            if slot.arena is not None:
                self._release(slot.arena)
        drop_staging(self.spec.name)
