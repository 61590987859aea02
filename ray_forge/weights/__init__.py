"""Versioned weight store: each trainer rank puts its own shards of a version, every policy engine
takes the whole version in place.

Transports: ``shm`` (same node, the local default), ``object_store`` (across nodes), ``nixl``
(Ray Direct Transport over NIXL: RDMA where the NICs allow, UCX over TCP elsewhere),
``collective`` (a push over torch.distributed: gloo on CPU, NCCL on GPU) and ``torchstore``.
"""

from ray_forge.weights.base import (
                                    Manifest,
                                    MixedWeights,
                                    Part,
                                    StoreSpec,
                                    SyncNotOpened,
                                    TransportUnavailable,
                                    WeightSyncError,
                                    version_key,
)
from ray_forge.weights.store import WeightStore, resolve_transport

__all__ = ["Manifest", "MixedWeights", "Part", "StoreSpec", "SyncNotOpened", "TransportUnavailable", "WeightStore",
           "WeightSyncError", "resolve_transport", "version_key"]
