"""A versioned weight store shaped like TorchStore: ``put_state_dict`` in the trainer,
``get_state_dict`` (into preallocated tensors) or ``iter_state_dict`` (into vLLM) in receivers.

Keys are ``policy_ver_<version>.<param>``; at most ``keep_versions`` versions stay alive. Every wait
has the spec's timeout and a failure names the sender and the version.
"""

from __future__ import annotations

import time
from typing import Iterator

import ray
import torch

from ray_forge.weights.base import Manifest, StoreSpec, Transport, WeightSyncError
from ray_forge.weights.controller import ControllerActor
from ray_forge.weights.layout import plan_buckets, unpack


def version_key(version: int) -> str:
    return f"policy_ver_{version:010d}"


def make_transport(spec: StoreSpec) -> Transport:
    if spec.transport == "shm":
        from ray_forge.weights.shm import SharedMemoryTransport
        return SharedMemoryTransport(spec)
    if spec.transport == "object_store":
        from ray_forge.weights.object_store import ObjectStoreTransport
        return ObjectStoreTransport(spec)
    if spec.transport == "torchstore":
        from ray_forge.weights.torchstore_transport import TorchStoreTransport
        return TorchStoreTransport(spec)
    from ray_forge.weights.nccl import NcclPushTransport
    return NcclPushTransport(spec)


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
        try:
            return ray.get(ref, timeout=timeout_s or self.spec.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncError(f"weight store controller did not answer {what} in time") from None
        except ray.exceptions.RayActorError as err:
            raise WeightSyncError(f"weight store controller died during {what}") from err

    # -- sender ------------------------------------------------------------------------------
    def put_state_dict(self, version: int, state_dict: dict[str, torch.Tensor]) -> Manifest:
        """Write a version through the transport, publish it, and free versions beyond the limit."""
        buckets = plan_buckets(state_dict, self.spec.bucket_bytes, self.spec.dtype)
        location = self.transport.write(version, buckets, state_dict)
        manifest = Manifest(version, self.spec.sender, self.spec.transport, tuple(buckets), location)
        evicted = self._ask(self.controller.publish.remote(manifest, self.spec.keep_versions, self.spec), "publish")
        for old in evicted:
            self.transport.free(old)
        return manifest

    # -- receivers ---------------------------------------------------------------------------
    def manifest(self, version: int, deadline: float | None = None) -> Manifest:
        deadline = deadline or time.monotonic() + self.spec.timeout_s
        wait_s = max(0.0, deadline - time.monotonic())
        found = self._ask(self.controller.manifest.remote(version, wait_s), f"manifest({version})", wait_s + 10)
        if found is None:
            live = self.versions()
            reason = ("it was evicted" if live and version < live[0]
                      else f"{self.spec.sender} did not publish it within {self.spec.timeout_s:.0f}s "
                           "(is the sender alive?)")
            raise WeightSyncError(f"weights version {version} from {self.spec.sender} are not available: "
                                  f"{reason}; live versions {live}")
        return found

    def iter_state_dict(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, one bucket at a time; each tensor is valid until the next bucket
        is requested, so a consumer that copies as it goes (vLLM's loader) holds one bucket."""
        deadline = time.monotonic() + self.spec.timeout_s
        manifest = self.manifest(version, deadline)
        for bucket, buffer in self.transport.read(manifest, deadline):
            yield from unpack(bucket, buffer)
            if time.monotonic() > deadline:
                raise WeightSyncError(f"weights version {version} from {self.spec.sender} took longer than "
                                      f"{self.spec.timeout_s:.0f}s to read")

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
            self.transport.free(manifest)

    def destroy(self) -> None:
        """Free every version and stop the controller (the run is over)."""
        for version in self.versions():
            self.delete(version)
        if hasattr(self.transport, "destroy"):
            self.transport.destroy()
        ray.kill(self.controller, no_restart=True)
