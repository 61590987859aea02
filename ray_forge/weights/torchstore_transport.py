"""TorchStore as a transport, where it can be imported.

torchstore 0.1.2 pins torch 2.9 and a Monarch build that links libcuda, and its controller and
storage volumes are Monarch actors, so it cannot share an environment with this project's CPU
stack. This adapter is therefore untested here: it stores each packed bucket as one uint8 tensor
under ``<version key>/bucket_<i>`` and reads it back into a preallocated buffer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Iterator, Mapping

import torch

from ray_forge.weights.base import Part, StoreSpec, TransportUnavailable, version_key
from ray_forge.weights.controller import ControllerClient
from ray_forge.weights.layout import Bucket, pack_into
from ray_forge.weights.stored import StoredTransport


def import_torchstore():
    try:
        import torchstore
    except Exception as err:  # ImportError, or Monarch failing to load libcuda
        raise TransportUnavailable(
            f"weights.transport=torchstore needs the torchstore package and Monarch, which failed to import "
            f"({err.__class__.__name__}: {err}). torchstore 0.1.2 pins torch 2.9 and a CUDA Monarch build; "
            "use weights.transport=shm or object_store instead") from err
    return torchstore


class TorchStoreTransport(StoredTransport):
    def __init__(self, spec: StoreSpec, client: ControllerClient) -> None:
        super().__init__(spec, client)
        self.ts = import_torchstore()

    def _key(self, version: int, rank: int, index: int) -> str:
        return f"{self.spec.name}/{version_key(version)}/rank_{rank:03d}/bucket_{index:05d}"

    def write(self, version: int, rank: int, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor]) -> list[str]:
        keys = []
        for bucket in buckets:
            packed = torch.empty(bucket.nbytes, dtype=torch.uint8)
            pack_into(bucket, tensors, packed)
            keys.append(self._key(version, rank, bucket.index))
            asyncio.run(asyncio.wait_for(self.ts.put(keys[-1], packed), timeout=self.spec.timeout_s))
        return keys

    def read(self, part: Part, deadline: float) -> Iterator[tuple[Bucket, torch.Tensor]]:
        for key, bucket in zip(part.location, part.buckets):
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
            wait_s = max(0.0, deadline - time.monotonic())
            asyncio.run(asyncio.wait_for(self.ts.get(key, inplace_tensor=buffer), timeout=wait_s))
            yield bucket, buffer

    def free(self, part: Part) -> None:
        for key in part.location:
            asyncio.run(self.ts.delete(key))
