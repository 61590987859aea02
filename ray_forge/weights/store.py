"""A versioned weight store shaped like TorchStore: ``put_state_dict`` (one process holds the
whole model) or ``put_shards`` (each trainer rank puts its own rows) in the trainer,
``get_state_dict`` (into preallocated tensors) or ``fetch`` + ``iter_manifest`` (into vLLM) in
receivers. Every transport is driven the same way (``base.Transport``); how the bytes travel is
the transport's business.

Keys are ``policy_ver_<version>.<param>``; at most ``keep_versions`` versions stay alive. Every wait
has the spec's timeout and a failure names the sender and the version.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Mapping

import torch

from ray_forge.weights.base import (Manifest, Part, StoreSpec, Transport, TransportUnavailable, WeightSyncError,
                                    version_key)
from ray_forge.weights.controller import ControllerClient
from ray_forge.weights.layout import Bucket, Piece, assemble, plan_pieces, whole_pieces

log = logging.getLogger(__name__)


def resolve_transport(choice: str, trainer_nodes: list[str], policy_nodes: list[str]) -> str:
    """What 'auto' is, from ``bench/weight_sync.py`` (README, Weight sync): shared memory when every
    policy and every trainer rank share one node (each rank writes its shards on its own node);
    across nodes NIXL, where it imports (it read 2.6x the object store's rate between two local
    nodes, about as fast over plain TCP, RDMA where the NICs allow, and its transfer runs off the
    engines' step loops), else the object store. 'nccl' is the old name of 'collective'."""
    if choice == "nccl":
        log.warning("weights.transport=nccl is deprecated: it is now 'collective' (NCCL on GPUs, gloo on CPUs)")
        return "collective"
    if choice != "auto":
        return choice
    if len(set(trainer_nodes) | set(policy_nodes)) == 1:
        return "shm"
    try:
        from ray_forge.weights.nixl import import_rdt

        import_rdt()
        return "nixl"
    except TransportUnavailable as err:
        log.info("weights.transport=auto: across nodes NIXL would be the choice, but %s; using object_store", err)
        return "object_store"


def make_transport(spec: StoreSpec, client: ControllerClient) -> Transport:
    if spec.transport == "shm":
        from ray_forge.weights.shm import SharedMemoryTransport
        return SharedMemoryTransport(spec, client)
    if spec.transport == "object_store":
        from ray_forge.weights.object_store import ObjectStoreTransport
        return ObjectStoreTransport(spec, client)
    if spec.transport == "nixl":
        from ray_forge.weights.nixl import NixlTransport
        return NixlTransport(spec, client)
    if spec.transport == "torchstore":
        from ray_forge.weights.torchstore_transport import TorchStoreTransport
        return TorchStoreTransport(spec, client)
    from ray_forge.weights.collective import CollectiveTransport
    return CollectiveTransport(spec, client)


class WeightStore:
    """A client of one store; cheap to open in any process that can reach the Ray cluster."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self.client = ControllerClient(spec)
        self.transport = make_transport(spec, self.client)

    @classmethod
    def create(cls, spec: StoreSpec) -> "WeightStore":
        """Start the store's controller (owned by the calling process, normally the driver)."""
        store = cls(spec)
        store.client.start()
        return store

    @property
    def controller(self):
        """The controller actor's handle."""
        return self.client.handle

    # -- senders -----------------------------------------------------------------------------
    def put_state_dict(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> Part:
        """Write a whole state dict as one part, publish it, and free versions beyond the limit."""
        return self.put_shards(version, whole_pieces(state_dict))

    def put_shards(self, version: int, pieces: list[Piece], rank: int = 0, num_ranks: int = 1,
                   sender: str | None = None) -> Part:
        """Put this rank's pieces as its part of ``version``. The version is published once all
        ``num_ranks`` parts are in. The put never waits for the other ranks; over a transport that
        pushes into live engines it returns once they have received it."""
        sender = sender or self.spec.sender_name(rank, num_ranks)
        buckets = plan_pieces(pieces, self.spec.bucket_bytes, self.spec.dtype)
        tensors = {p.key: p.tensor for p in pieces if p.tensor is not None}
        part = Part(version, sender, self.spec.transport, tuple(buckets), None, rank)
        return self.transport.put(part, tensors, lambda ready: self._publish(ready, num_ranks))

    def _publish(self, part: Part, num_ranks: int) -> None:
        for old in self.client.put_part(part, num_ranks):
            self.transport.free(old)

    # -- receivers ---------------------------------------------------------------------------
    def manifest(self, version: int, deadline: float | None = None) -> Manifest:
        """The version's manifest, once published (waiting up to the spec's timeout)."""
        return self.client.manifest(version, deadline or time.monotonic() + self.spec.timeout_s)

    def fetch(self, version: int, member: str = "", worker: int = 0, deadline: float | None = None) -> Manifest | None:
        """Wait for ``version`` and bring its bytes into this process where the transport holds
        them between fetching and loading; its manifest, for :meth:`iter_manifest`. ``member``
        names the engine (and ``worker`` its worker) for a transport that streams into named
        engines; None when the version does not go to it."""
        return self.transport.fetch(version, member, worker, deadline or time.monotonic() + self.spec.timeout_s)

    def iter_state_dict(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) pairs, one group of buckets at a time; each tensor is valid until the
        next one is requested, so a consumer that copies as it goes (vLLM's loader) holds about one
        bucket beyond its model, however many ranks the version came from."""
        deadline = time.monotonic() + self.spec.timeout_s
        manifest = self.fetch(version, deadline=deadline)
        if manifest is None:
            raise WeightSyncError(f"weights version {version} went over {self.spec.transport} to named engines only: "
                                  "this process cannot read it")
        yield from self.iter_manifest(manifest, deadline)

    def iter_manifest(self, manifest: Manifest, deadline: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``iter_state_dict`` of a version already fetched: asks the controller nothing, so it runs
        where Ray is not (a tensor-parallel engine's worker processes, over shm)."""
        deadline = deadline or time.monotonic() + self.spec.timeout_s
        what = f"weights version {manifest.version} from {manifest.sender}"
        for name, tensor in assemble(self._read_in_group_order(manifest, deadline), what):
            yield name, tensor
            if time.monotonic() > deadline:
                raise WeightSyncError(f"{what} took longer than {self.spec.timeout_s:.0f}s to read")

    def _read_in_group_order(self, manifest: Manifest, deadline: float) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """The version's buckets in group order: one reader per part, advanced in step."""
        readers = {part.rank: iter(self.transport.read(part, deadline)) for part in manifest.parts}
        for part, _ in manifest.in_group_order():
            yield next(readers[part.rank])

    def get_state_dict(self, version: int,
                       into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Copy a version into ``into`` in place (converting to each tensor's dtype), or return
        fresh tensors when ``into`` is None."""
        if into is None:
            return {name: tensor.clone() for name, tensor in self.iter_state_dict(version)}
        seen = set()
        for name, tensor in self.iter_state_dict(version):
            if name not in into:
                raise KeyError(f"{version_key(version)}.{name} has no preallocated tensor in `into`")
            into[name].copy_(tensor)
            seen.add(name)
        if missing := set(into) - seen:
            raise KeyError(f"{version_key(version)} has no tensors for {sorted(missing)[:5]}")
        return into

    # -- bookkeeping -------------------------------------------------------------------------
    def versions(self) -> list[int]:
        return self.client.versions()

    def keys(self, version: int) -> list[str]:
        return [f"{version_key(version)}.{name}" for name in self.manifest(version).names()]

    def delete(self, version: int) -> None:
        manifest = self.client.delete(version)
        if manifest is not None:
            for part in manifest.parts:
                self.transport.free(part)

    def close(self) -> None:
        """Release what this client holds in its own process (shared-memory folders it wrote on
        this node, registered buffers, push groups); the versions' records stay with the controller."""
        self.transport.destroy()

    def destroy(self) -> None:
        """Free every version and stop the controller (the run is over)."""
        for version in self.versions():
            self.delete(version)
        self.close()
        self.client.kill()
