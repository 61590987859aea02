"""A versioned weight store shaped like TorchStore: ``put_state_dict`` (one process holds the
whole model) or ``put_shards`` (each trainer rank puts its own rows) in the trainer,
``get_state_dict`` (into preallocated tensors) or ``iter_state_dict`` (into vLLM) in receivers.

Keys are ``policy_ver_<version>.<param>``; at most ``keep_versions`` versions stay alive. Every wait
has the spec's timeout and a failure names the sender and the version.
"""

from __future__ import annotations

import time
from typing import Iterator, Mapping

import ray
import torch

from ray_forge.weights.base import Manifest, Part, StoreSpec, Transport, WeightSyncError, version_key
from ray_forge.weights.controller import ControllerActor
from ray_forge.weights.layout import Bucket, Piece, assemble, plan_pieces, whole_pieces


CONTROLLER_TIMEOUT_S = 60.0


def make_transport(spec: StoreSpec) -> Transport:
    if spec.transport == "shm":
        from ray_forge.weights.shm import SharedMemoryTransport
        return SharedMemoryTransport(spec)
    if spec.transport == "object_store":
        from ray_forge.weights.object_store import ObjectStoreTransport
        return ObjectStoreTransport(spec)
    if spec.transport == "nixl":
        from ray_forge.weights.nixl import NixlTransport
        return NixlTransport(spec)
    if spec.transport == "torchstore":
        from ray_forge.weights.torchstore_transport import TorchStoreTransport
        return TorchStoreTransport(spec)
    from ray_forge.weights.collective import CollectiveTransport
    return CollectiveTransport(spec)


class WeightStore:
    """A client of one store; cheap to open in any process that can reach the Ray cluster."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self.transport = make_transport(spec)
        self._controller = None

    @classmethod
    def create(cls, spec: StoreSpec) -> "WeightStore":
        """Start the store's controller (owned by the calling process, normally the driver)."""
        store = cls(spec)
        # Keep this handle: Ray stops an actor once its creator's handles are gone.
        store._controller = ControllerActor.options(name=spec.controller_name, get_if_exists=True).remote()
        store._ask(store._controller.versions.remote(), "start-up", timeout_s=max(60.0, spec.timeout_s))
        return store

    @property
    def controller(self):
        if self._controller is None:
            try:
                self._controller = ray.get_actor(self.spec.controller_name)
            except ValueError:
                raise WeightSyncError(f"weight store {self.spec.name!r} has no controller; "
                                      "create it with WeightStore.create(spec) first") from None
        return self._controller

    def _ask(self, ref, what: str, timeout_s: float | None = None):
        """The controller's answer. Its bookkeeping calls get at least CONTROLLER_TIMEOUT_S whatever
        the transfer timeout: the first ref of a direct transport (nixl) that reaches it starts Ray's
        transport manager there, which takes seconds."""
        try:
            return ray.get(ref, timeout=timeout_s or max(self.spec.timeout_s, CONTROLLER_TIMEOUT_S))
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncError(f"weight store controller did not answer {what} in time") from None
        except ray.exceptions.RayActorError as err:
            raise WeightSyncError(f"weight store controller died during {what}") from err

    # -- senders -----------------------------------------------------------------------------
    def put_state_dict(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> Part:
        """Write a whole state dict as one part, publish it, and free versions beyond the limit."""
        return self.put_shards(version, whole_pieces(state_dict))

    def put_shards(self, version: int, pieces: list[Piece], rank: int = 0, num_ranks: int = 1,
                   sender: str | None = None) -> Part:
        """Write this rank's pieces as its part of ``version``. The version is published once all
        ``num_ranks`` parts are in; the put itself never waits for the other ranks or a receiver,
        except over a push transport, which streams into the receivers before it returns."""
        sender = sender or self.spec.sender_name(rank, num_ranks)
        buckets = plan_pieces(pieces, self.spec.bucket_bytes, self.spec.dtype)
        tensors = {p.key: p.tensor for p in pieces if p.tensor is not None}
        if self.spec.pushes:
            # Receivers learn every rank's layout from the manifest, then the bytes stream in.
            part = Part(version, sender, self.spec.transport, tuple(buckets), None, rank)
            self.publish_part(part, num_ranks)
            self.transport.push(part, tensors, self)
            return part
        location = self.transport.write(version, rank, buckets, tensors)
        part = Part(version, sender, self.spec.transport, tuple(buckets), location, rank)
        self.publish_part(part, num_ranks)
        return part

    def publish_part(self, part: Part, num_ranks: int) -> None:
        evicted = self._ask(self.controller.put_part.remote(part, num_ranks, self.spec.keep_versions, self.spec),
                            f"put_part({part.version}, rank {part.rank})")
        for old in evicted:
            self.transport.free(old)

    # -- receivers ---------------------------------------------------------------------------
    def manifest(self, version: int, deadline: float | None = None) -> Manifest:
        deadline = deadline or time.monotonic() + self.spec.timeout_s
        wait_s = max(0.0, deadline - time.monotonic())
        found = self._ask(self.controller.manifest.remote(version, wait_s), f"manifest({version})", wait_s + 10)
        if found is None:
            raise WeightSyncError(f"weights version {version} from {self._senders()} are not available: "
                                  f"{self._why_missing(version)}; live versions {self.versions()}")
        return found

    def _senders(self) -> str:
        return ", ".join(self.spec.senders) or self.spec.sender

    def _why_missing(self, version: int) -> str:
        live = self.versions()
        missing = self._ask(self.controller.missing_parts.remote(version), f"missing_parts({version})")
        if (live and version < live[0]) or missing is None:
            return "it was evicted"
        num_ranks = max(len(self.spec.senders), 1 + max(missing, default=0))
        names = ", ".join(self.spec.sender_name(r, num_ranks) for r in missing)
        did = "did not publish it" if len(missing) == num_ranks else "did not put its part"
        return f"{names} {did} within {self.spec.timeout_s:.0f}s (is the sender alive?)"

    def iter_state_dict(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) pairs, one group of buckets at a time; each tensor is valid until the
        next one is requested, so a consumer that copies as it goes (vLLM's loader) holds about one
        bucket beyond its model, however many ranks the version came from."""
        if self.spec.pushes:
            raise WeightSyncError(f"weights over {self.spec.transport} are pushed into the engines, not stored: "
                                  f"version {version} cannot be read back")
        deadline = time.monotonic() + self.spec.timeout_s
        yield from self.iter_manifest(self.manifest(version, deadline), deadline)

    def iter_manifest(self, manifest: Manifest, deadline: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``iter_state_dict`` of a manifest already in hand: asks the controller nothing, so it
        runs where Ray is not (a tensor-parallel engine's worker processes, over shm)."""
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
        return self._ask(self.controller.versions.remote(), "versions()")

    def keys(self, version: int) -> list[str]:
        return [f"{version_key(version)}.{name}" for name in self.manifest(version).names()]

    def delete(self, version: int) -> None:
        manifest = self._ask(self.controller.delete.remote(version), f"delete({version})")
        if manifest is not None:
            for part in manifest.parts:
                self.transport.free(part)

    def close(self) -> None:
        """Release what this client holds in its own process (shared-memory folders it wrote on
        this node, push groups); the versions' records stay with the controller."""
        self.transport.destroy()

    def destroy(self) -> None:
        """Free every version and stop the controller (the run is over)."""
        for version in self.versions():
            self.delete(version)
        self.close()
        ray.kill(self.controller, no_restart=True)
