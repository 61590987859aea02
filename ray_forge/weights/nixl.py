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

The sender keeps ``keep_versions + 1`` arenas (the live versions and the one being written: that
many copies of its shard) and writes into one again once no one will read its last version:
the controller has evicted it, and every engine it went to has said it holds its own copy
(``read_done``) or was found dead by the run (``receiver_gone``). Ray's own count of the refs
(``wait_tensor_freed``) is not waited for then: it learns of a drop asynchronously, and of a
receiver lost with its node it may never learn (the borrower stays counted while Ray's GCS is
busy rescheduling, which held an arena for good and stopped the run). A reused arena gets new
view tensors, as Ray keys its record of the old object by the tensors' identity. A version read
by a receiver that gave no name is free only when Ray says so: when the oldest arena is still
referenced after ``REF_GRACE_S``, the rank writes into a spare one (at most ``SPARE_ARENAS``)
rather than hold up the sync, and takes the held one back once it is freed.

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
_UCX_SEEN: set[str] = set()
_UCX_DIR_PREFIX = "ray_forge-ucx-"

UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
"""Where UCX reads over TCP (no RDMA NICs), it emulates the read with messages of this size.
Its 8 KiB default moved a 1 GB read at 0.5-0.8 GB/s between two local Ray nodes here; 1 MiB at
1.2-3.4 GB/s (2026-12-03, this 2-core machine). A value the user set is kept."""


def watch_ucx() -> None:
    """Before this process's NIXL agent starts (UCX reads its settings then): apply
    ``UCX_DEFAULTS``, and ask UCX to write the protocols it selects for remote reads, the way
    buckets travel, into a folder of this process (unless the user set UCX_PROTO_INFO
    themselves; UCX prints to stdout where the folder is missing). ``note_ucx_transports`` reads
    and removes its files after each fetch; the empty folder goes when the process exits, or, where
    it was killed, when the next process here makes its own (``sweep_ucx_dirs``)."""
    global _UCX_INFO_DIR
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # A process started by one that watched UCX (Ray's nodes, started by a driver) inherits its
    # settings: those are not the user's, and this process needs a folder of its own.
    inherited = Path(os.environ.get("UCX_PROTO_INFO_DIR", "")).name.startswith(_UCX_DIR_PREFIX)
    if _UCX_INFO_DIR is None and ("UCX_PROTO_INFO" not in os.environ or inherited):
        sweep_ucx_dirs(Path(tempfile.gettempdir()))
        _UCX_INFO_DIR = Path(tempfile.mkdtemp(prefix=f"{_UCX_DIR_PREFIX}{os.getpid()}-"))
        atexit.register(shutil.rmtree, _UCX_INFO_DIR, ignore_errors=True)
        os.environ["UCX_PROTO_INFO"] = "*get*"
        os.environ["UCX_PROTO_INFO_DIR"] = str(_UCX_INFO_DIR)


def sweep_ucx_dirs(parent: Path) -> list[Path]:
    """Remove the empty UCX folders in ``parent`` of processes that are gone: a process killed
    (as Ray kills actors) never runs its exit hook, and each left one behind. Only empty folders
    go (``rmdir``), so a folder of a live process in another pid namespace that shares this /tmp
    loses nothing but a file UCX writes again. Returns the folders removed."""
    removed = []
    for path in parent.glob(f"{_UCX_DIR_PREFIX}*-*"):
        pid = re.fullmatch(rf"{_UCX_DIR_PREFIX}(\d+)-.+", path.name)
        if pid is None or _alive(int(pid.group(1))):
            continue
        try:
            path.rmdir()
        except OSError:  # not empty, not ours, or removed by another sweeping process
            continue
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def note_ucx_transports() -> None:
    """After a fetch: read what UCX wrote about the reads it set up, log the transports not seen
    before in this process, and remove the files (UCX writes them again for a new peer)."""
    if _UCX_INFO_DIR is None:
        return
    found = set()
    for path in _UCX_INFO_DIR.glob("*.dot"):
        if "_get_" in path.name:
            where = "intra-node" if "_intra_node_" in path.name else "inter-node"
            match = re.search(r'node0 \[label="[^"\\]*\\n([^"]+)"', path.read_text(errors="replace"))
            if match:
                found.add(f"{match.group(1)} ({where})")
        path.unlink(missing_ok=True)
    if new := found - _UCX_SEEN:
        _UCX_SEEN.update(new)
        log.info("weights over NIXL: UCX reads remote memory over %s", ", ".join(sorted(new)))


def ucx_transports() -> list[str]:
    """The UCX transports this process has read remote memory over, e.g.
    ``['cma/memory (intra-node)']`` or ``['rc_mlx5/mlx5_0:1 (inter-node)']``; empty when unknown."""
    note_ucx_transports()
    return sorted(_UCX_SEEN)


PROGRESS_DELAY_US = 10_000
"""How long NIXL's progress thread waits between two looks at its UCX worker when nothing woke
it. NIXL's Python API starts every agent (Ray's included) with no wait at all, and the thread
then spins: an idle agent took a whole core (3.0 s of CPU in 3 s); in the ``make demo`` job the
trainer's and both engines' threads took 25-45% of a core each and the job ran at half speed.
The thread still wakes at once on UCX's event (the worker is armed): with 1 ms or 10 ms a 1 GB
read between two local Ray nodes ran at 1.7-3.1 GB/s over tcp and 4.5-6.4 over cma, against
1.2-3.4 and 3-4 spinning (2026-12-03, this 2-core machine), and an idle agent took 0.1 s of CPU
in 3 s."""


def calm_progress_thread() -> None:
    """Make the NIXL agents this process creates from now on wait ``PROGRESS_DELAY_US`` in their
    progress thread rather than spin. NIXL's Python API sets the delay to 0 on the agent's config
    object as it builds it; a config type of ours keeps a larger value when it is asked for 0."""
    import nixl._api as api

    bindings = api.nixlBind
    if getattr(bindings, "ray_forge_calm", False):
        return

    class CalmConfig(bindings.nixlAgentConfig):
        def __setattr__(self, name, value):
            if name == "pthrDelay":
                value = max(int(value), PROGRESS_DELAY_US)
            super().__setattr__(name, value)

    class Bindings:
        ray_forge_calm = True
        nixlAgentConfig = CalmConfig

        def __getattr__(self, name):
            return getattr(bindings, name)

    api.nixlBind = Bindings()


def import_rdt():
    """Ray's RDT functions, after checking that NIXL itself imports (Ray would fail later, in a transfer)."""
    watch_ucx()
    try:
        import nixl._api  # noqa: F401  the meta package's shim loads the cu12 build's bindings
        from ray.experimental import (deregister_nixl_memory, register_nixl_memory, set_target_for_ref,
                                      wait_tensor_freed)
        calm_progress_thread()
    except Exception as err:
        raise TransportUnavailable(
            f"weights.transport=nixl needs NIXL's Python package, which failed to import "
            f"({err.__class__.__name__}: {err}). Install nixl-cu12==1.5.1, then nixl==1.5.1 with --no-deps "
            "(`make venv` does both), or choose weights.transport=shm or object_store") from err
    return register_nixl_memory, deregister_nixl_memory, set_target_for_ref, wait_tensor_freed


class _Slot:
    """One arena of send buffers: a view per bucket index, as last put, and the version put."""

    def __init__(self) -> None:
        self.arena: torch.Tensor | None = None
        self.layout: tuple[tuple[int, int], ...] = ()
        self.views: dict[int, torch.Tensor] = {}
        self.version = -1


_SENDING: dict[str, list[_Slot]] = {}
"""A sending process's arenas, by store. Kept per process, not per client: a second client of the
same store in this process (a fresh ``WeightStore``) reuses them, so no registered memory is
dropped while Ray still caches its registration."""


REF_RELEASE_S = 30.0
"""Least wait for the refs of an arena's last version to be freed once no spare arena is left:
Ray tells the owner that a borrower (a receiver that read the version) dropped its ref
asynchronously, which on a busy machine takes seconds, so a short ``weights.timeout_s`` does not
bound this wait."""

REF_GRACE_S = 5.0
"""How long a rank waits for the oldest arena's refs before it writes into a spare one."""

SPARE_ARENAS = 2
"""Arenas a rank may add beyond ``keep_versions + 1`` while older ones are still referenced (a
receiver that died holding refs: Ray frees them once it notices, which took over 30 s on a
loaded CI machine). Each is one more copy of the rank's shard."""


class NixlTransport(StoredTransport):
    def __init__(self, spec: StoreSpec, client: ControllerClient) -> None:
        super().__init__(spec, client)
        self._register, self._deregister, self._set_target, self._wait_freed = import_rdt()

    # -- sender --------------------------------------------------------------------------------
    def write(self, version: int, rank: int, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor]):
        if not buckets:
            return None  # this rank holds no rows of any tensor: nothing to read
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        slot = self._free_slot(version, rank, buckets, device)
        views = [slot.views[bucket.index] for bucket in buckets]
        with _LOCK:
            for bucket, view in zip(buckets, views):
                pack_into(bucket, tensors, view)
            ref = ray.put(views, _tensor_transport="nixl")
        return ref

    def _free_slot(self, version: int, rank: int, buckets: list[Bucket], device: torch.device) -> _Slot:
        """An arena no ref to what it last held is alive in (the oldest such), laid out for
        ``buckets``: a fresh one while fewer than ``keep_versions + 1`` exist, a spare one when the
        oldest is still referenced after ``REF_GRACE_S``; past the spares, an error once
        ``REF_RELEASE_S`` is up."""
        slots = _SENDING.setdefault(self.spec.name, [])
        start = time.monotonic()
        slot = self._unreferenced(slots) or self._added(slots, self.spec.keep_versions + 1) or self._reclaimed(slots, version)
        if slot is None:
            oldest = min(slots, key=lambda s: s.version)
            if self._freed(oldest, start + REF_GRACE_S):
                slot = oldest
            elif (slot := self._unreferenced(slots) or self._added(slots, self.spec.keep_versions + 1 + SPARE_ARENAS)):
                log.warning("weights version %d (rank %d) goes into a spare buffer (%d of %d): the buffers of version "
                            "%d are still referenced after %.0fs (a receiver died holding them, or Ray is slow to "
                            "tell)", version, rank, len(slots) - self.spec.keep_versions - 1, SPARE_ARENAS,
                            oldest.version, REF_GRACE_S)
            elif self._freed(oldest, start + max(self.spec.timeout_s, REF_RELEASE_S)):
                slot = oldest
            else:
                held = sorted(s.version for s in slots)
                raise WeightSyncError(
                    f"weights version {version}: the buffers of versions {held} are all still referenced after "
                    f"{time.monotonic() - start:.0f}s (a receiver or the controller holds their refs), so none "
                    "can be written again")
        slot.version = version
        layout = tuple((b.index, b.nbytes) for b in buckets)
        if layout != slot.layout or slot.arena is None or slot.arena.device != device:
            if slot.arena is not None:
                self._release(slot.arena)  # the layout changed: this arena no longer fits
            slot.arena, slot.views = arena(layout, self._registered, device)
            slot.layout = layout
        return slot

    def _reclaimed(self, slots: list[_Slot], version: int) -> _Slot | None:
        """The arena of the oldest version no one will read again (the controller knows who read
        it), with new views: Ray may still count refs to the old ones (see the module's docstring)."""
        free = self.client.reclaimable([s.version for s in slots])
        slot = min((s for s in slots if s.version in free), key=lambda s: s.version, default=None)
        if slot is None:
            return None
        if gone := free[slot.version]:
            log.warning("weights version %d goes into the buffers of version %d, which only receivers found dead "
                        "still hold (%s): Ray may never count their refs as gone",
                        version, slot.version, ", ".join(f"{name} (process {pid})" for name, pid in gone))
        slot.views = {index: view[:] for index, view in slot.views.items()}
        return slot

    def _unreferenced(self, slots: list[_Slot]) -> _Slot | None:
        """The arena holding the oldest version no ref is alive to, if any (no wait)."""
        return next((s for s in sorted(slots, key=lambda s: s.version) if self._freed(s, 0.0)), None)

    @staticmethod
    def _added(slots: list[_Slot], most: int) -> _Slot | None:
        if len(slots) >= most:
            return None
        slots.append(_Slot())
        return slots[-1]

    def _freed(self, slot: _Slot, deadline: float) -> bool:
        """Whether every view put from ``slot`` is freed by ``deadline`` (Ray tracks the objects themselves)."""
        try:
            for view in slot.views.values():
                self._wait_freed(view, timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return True

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
        """Every bucket of ``version`` into this process's registered arena: one transfer per part.
        A named receiver (an engine) then tells the controller it needs the sender's bytes no more."""
        reader = (member, os.getpid()) if member else None
        manifest = self.client.manifest(version, deadline, reader)
        staging = staging_for(self.spec.name, self._registered, self._release)
        buffers = staging.prepare(manifest, receiving_device())
        for part in manifest.parts:
            if part.buckets:
                self._receive(part, [buffers[(part.rank, b.index)] for b in part.buckets], deadline)
        staging.mark(version)
        if reader is not None:
            self.client.read_done(version, reader)
        note_ucx_transports()
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

    def holds(self, manifest: Manifest) -> bool:
        staging = staging_for(self.spec.name, self._registered, self._release)
        return all(staging.holds(part) for part in manifest.parts)

    def route(self) -> str:
        return f"nixl (UCX: {', '.join(ucx_transports()) or 'not reported yet'})"

    def destroy(self) -> None:
        for slot in _SENDING.pop(self.spec.name, []):
            if slot.arena is not None:
                self._release(slot.arena)
        drop_staging(self.spec.name)
