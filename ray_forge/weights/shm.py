"""Same-node transport: each bucket is a file in ``/dev/shm`` that receivers map, one at a time.

The sender writes each bucket once (converting dtypes on the way); a receiver maps a bucket,
copies or loads its tensors straight out of the mapping, and unmaps it before the next, so its
extra memory stays within about one bucket.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

import ray
import torch

from ray_forge.weights.base import Manifest, Part, StoreSpec, WeightSyncError, version_key
from ray_forge.weights.controller import ControllerClient
from ray_forge.weights.layout import Bucket, pack_into
from ray_forge.weights.stored import StoredTransport


def default_root() -> Path:
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "ray_forge"


def _node_id() -> str | None:
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def map_file(path: Path, nbytes: int, writable: bool) -> torch.Tensor:
    """A uint8 tensor over the file's pages; the mapping lives as long as the tensor (no copy)."""
    with open(path, "r+b" if writable else "rb") as f:
        if writable:
            os.ftruncate(f.fileno(), nbytes)
        # Readers map privately: writable as torch wants, yet a read maps the shared page itself
        # (copy-on-write only on a write, which never happens). No MAP_POPULATE for them: on a
        # private writable mapping it would pre-copy every page.
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE if writable else mmap.MAP_PRIVATE
        mapped = mmap.mmap(f.fileno(), nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapped, dtype=torch.uint8)


class SharedMemoryTransport(StoredTransport):
    def __init__(self, spec: StoreSpec, client: ControllerClient, root: Path | None = None) -> None:
        super().__init__(spec, client)
        self.root = (root or default_root()) / spec.name

    def version_dir(self, version: int, rank: int = 0) -> Path:
        """One folder per rank's part (ranks may share a node)."""
        return self.root / (version_key(version) + (f"-rank{rank}" if rank else ""))

    def write(self, version: int, rank: int, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor]) -> dict:
        final = self.version_dir(version, rank)
        staging = final.with_name(final.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for bucket in buckets:
            path = staging / f"bucket_{bucket.index:05d}"
            path.touch()
            pack_into(bucket, tensors, map_file(path, bucket.nbytes, writable=True))
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)  # a reader never sees a half-written version
        return {"dir": str(final), "node_id": _node_id()}

    def fetch(self, version: int, member: str, worker: int, deadline: float) -> Manifest:
        """The manifest, once every part of it is known to lie in this node's shared memory."""
        manifest = super().fetch(version, member, worker, deadline)
        for part in manifest.parts:
            self._check_node(part, _node_id())
        return manifest

    @staticmethod
    def _check_node(part: Part, here: str | None) -> None:
        if part.location["node_id"] not in (None, here):
            raise WeightSyncError(
                f"weights version {part.version} from {part.sender} are in shared memory on node "
                f"{part.location['node_id']}, but this process runs on node {here}; "
                "use weights.transport=object_store (or auto) when policies and trainer are on different nodes")

    def read(self, part: Part, deadline: float) -> Iterator[tuple[Bucket, torch.Tensor]]:
        here = _node_id()
        if here is not None:  # without Ray (a tensor-parallel engine's worker) the policy actor checked it
            self._check_node(part, here)
        folder = Path(part.location["dir"])
        for bucket in part.buckets:
            try:
                yield bucket, map_file(folder / f"bucket_{bucket.index:05d}", bucket.nbytes, writable=False)
            except FileNotFoundError:
                raise WeightSyncError(f"weights version {part.version} from {part.sender} was deleted "
                                      f"while being read (bucket {bucket.index} of {folder} is gone)") from None

    def free(self, part: Part) -> None:
        # Readers that still map a bucket keep its pages until they unmap (tmpfs semantics).
        shutil.rmtree(part.location["dir"], ignore_errors=True)

    def destroy(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
