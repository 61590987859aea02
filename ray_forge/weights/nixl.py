"""RDMA-capable transport: Ray Direct Transport (RDT) over NVIDIA's NIXL.

Each trainer rank packs its buckets into buffers it allocated and registered with NIXL once, and
publishes one RDT ref per bucket (``ray.put(..., _tensor_transport="nixl")``): the bytes stay in
the sender's memory, and only the refs travel, in the manifest. A receiver points each ref at a
buffer of its own, registered once too (``set_target_for_ref``), and ``ray.get`` makes NIXL read
the bytes straight into it: over InfiniBand or RoCE where the NICs exist, over UCX's ``tcp`` and
``cma`` (cross-memory attach) on a machine without them. On a GPU the same code moves CUDA tensors.

The sender keeps ``keep_versions + 2`` sets of buffers and writes into a set again only once Ray
says every ref to its last version is gone (``wait_tensor_freed``): the controller drops a
version's refs when it evicts it, and a receiver drops its own when it has read them. Two sets
beyond the live versions, because with several ranks an evicted part waits in the controller
until its rank's next put collects it, and that put writes first. A receiver
reads every bucket of a part before it hands out the first, so a transfer that fails (a dead
sender: Ray reports its owner died) fails before the engine loads anything.

NIXL's agent is not thread-safe by default, and the policy actor serves calls from several
threads: every NIXL call of a process goes through one lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Iterator, Mapping

import torch

from ray_forge.weights.base import Part, StoreSpec, Transport, TransportUnavailable, WeightSyncError
from ray_forge.weights.layout import Bucket, pack_into

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
"""One per process: NIXL's agent is not thread-safe (see the module's docstring)."""


def import_rdt():
    """Ray's RDT functions, after checking that NIXL itself imports (Ray would fail later, in a transfer)."""
    try:
        import nixl._api  # noqa: F401  the meta package's shim loads the cu12 build's bindings
        from ray.experimental import register_nixl_memory, set_target_for_ref, wait_tensor_freed
    except Exception as err:
        raise TransportUnavailable(
            f"weights.transport=nixl needs NIXL's Python package, which failed to import "
            f"({err.__class__.__name__}: {err}). Install nixl-cu12==1.5.1, then nixl==1.5.1 with --no-deps "
            "(`make venv` does both), or choose weights.transport=shm or object_store") from err
    return register_nixl_memory, set_target_for_ref, wait_tensor_freed


class NixlTransport(Transport):
    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self._register, self._set_target, self._wait_freed = import_rdt()
        self.slots: list[dict[int, torch.Tensor]] = []
        """The sender's sets of bucket buffers (bucket index -> uint8 buffer), used in turn."""
        self._next_slot = 0
        self.inbox: dict[tuple[int, int], torch.Tensor] = {}
        """The receiver's buffers, by (sender rank, bucket index)."""
        self._said_transports = False

    # -- sender --------------------------------------------------------------------------------
    def write(self, version: int, rank: int, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor]) -> tuple:
        import ray

        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        slot = self._free_slot(version, buckets, device)
        refs = []
        with _LOCK:
            for bucket in buckets:
                pack_into(bucket, tensors, slot[bucket.index])
                refs.append(ray.put([slot[bucket.index]], _tensor_transport="nixl"))
        self._say_transports()
        return tuple(refs)

    def _free_slot(self, version: int, buckets: list[Bucket], device: torch.device) -> dict[int, torch.Tensor]:
        """The next set of buffers, once no ref to what it last held is alive (a fresh set while
        fewer than ``keep_versions + 2`` exist)."""
        sizes = {b.index: b.nbytes for b in buckets}
        if len(self.slots) < self.spec.keep_versions + 2:
            self.slots.append({})
        slot = self.slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % (self.spec.keep_versions + 2)
        deadline = time.monotonic() + self.spec.timeout_s
        for index, buffer in list(slot.items()):
            with _LOCK:
                try:
                    self._wait_freed(buffer, timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise WeightSyncError(
                        f"weights version {version}: the buffers of an older version are still referenced after "
                        f"{self.spec.timeout_s:.0f}s (a receiver or the controller holds its refs), so they cannot "
                        "be written again") from None
            if sizes.get(index) != buffer.numel():
                del slot[index]  # the layout changed: this buffer no longer fits its bucket
        for index, nbytes in sizes.items():
            if index not in slot:
                slot[index] = self._registered(nbytes, device)
        return slot

    def _registered(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        with _LOCK:
            self._register(buffer)  # once: NIXL caches registrations by address
        return buffer

    def _say_transports(self) -> None:
        if not self._said_transports:
            self._said_transports = True
            log.info("weights over NIXL (UCX transports: %s)", os.environ.get("UCX_TLS") or "UCX's choice")

    # -- receiver ------------------------------------------------------------------------------
    def read(self, part: Part, deadline: float) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Every bucket of ``part`` into this process's buffers, then each in turn."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        received = [(bucket, self._receive(part, ref, bucket, deadline, device))
                    for ref, bucket in zip(part.location, part.buckets)]
        yield from received

    def _receive(self, part: Part, ref, bucket: Bucket, deadline: float, device: torch.device) -> torch.Tensor:
        import ray

        key = (part.rank, bucket.index)
        if key not in self.inbox or self.inbox[key].numel() != bucket.nbytes:
            self.inbox[key] = self._registered(bucket.nbytes, device)
        buffer = self.inbox[key]
        what = f"weights version {part.version} from {part.sender} (bucket {bucket.index})"
        with _LOCK:
            try:
                self._set_target(ref, [buffer])
                (got,) = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise WeightSyncError(f"{what} did not arrive within the {self.spec.timeout_s:.0f}s timeout") from None
            except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError) as err:
                raise WeightSyncError(f"{what} is lost: {part.sender} died ({err.__class__.__name__})") from None
            except ray.exceptions.RayError as err:
                raise WeightSyncError(f"{what} failed over NIXL: {err.__class__.__name__}: "
                                      f"{str(err).splitlines()[0] if str(err) else ''}") from None
        if got.data_ptr() != buffer.data_ptr():  # Ray would have allocated: the registered buffer was refused
            raise WeightSyncError(f"{what} was not received into its registered buffer")
        return buffer

    def free(self, part: Part) -> None:
        pass  # the controller drops the refs; the sender's next write into these buffers waits for that

    def destroy(self) -> None:
        self.slots.clear()
        self.inbox.clear()
