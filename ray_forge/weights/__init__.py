"""Versioned weight store: the trainer puts a version, every policy engine pulls it in place.

Transports: ``shm`` (same node, the local default), ``object_store`` (across nodes), ``nccl``
(GPU push through vLLM's weight-transfer API; untested without GPUs) and ``torchstore``.
"""

from ray_forge.weights.base import Manifest, StoreSpec, TransportUnavailable, WeightSyncError
from ray_forge.weights.store import WeightStore, version_key

__all__ = ["Manifest", "StoreSpec", "TransportUnavailable", "WeightStore", "WeightSyncError", "version_key"]
