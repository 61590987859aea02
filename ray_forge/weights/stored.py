"""What every transport that keeps a version for its readers shares (shm, object_store, nixl,
torchstore): the rank writes its buckets, then publishes its part; a reader waits for the
version's manifest, then reads the buckets from where they were written."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ray_forge.weights.base import Manifest, Part, StoreSpec
from ray_forge.weights.controller import ControllerClient
from ray_forge.weights.layout import Bucket


class StoredTransport:
    """What every transport that keeps a version for its readers shares: ``put`` writes, then
    publishes; ``fetch`` waits for the manifest. Subclasses write and read the bytes."""

    def __init__(self, spec: StoreSpec, client: ControllerClient) -> None:
        self.spec, self.client = spec, client

    def write(self, version: int, rank: int, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor]) -> Any:
        raise NotImplementedError

    def put(self, part: Part, tensors: Mapping[str, torch.Tensor], publish: Callable[[Part], None]) -> Part:
        location = self.write(part.version, part.rank, list(part.buckets), tensors)
        part = Part(part.version, part.sender, part.transport, part.buckets, location, part.rank)
        publish(part)
        return part

    def fetch(self, version: int, member: str, worker: int, deadline: float) -> Manifest | None:
        return self.client.manifest(version, deadline)

    def holds(self, manifest: Manifest) -> bool:
        return False  # read from where they are stored, not held here

    def route(self) -> str:
        return self.spec.transport

    def free(self, part: Part) -> None:
        pass

    def destroy(self) -> None:
        return None
