"""The store's vLLM-side hook: a worker extension, so each vLLM worker pulls weights itself.

vLLM mixes this class into its workers (``worker_extension_cls``); the policy actor reaches it
with ``collective_rpc("pull_weights", ...)``. The tensors go from the store's buckets straight
into ``reload_weights``, which copies them into the engine's own (possibly repacked) weights.
"""

from __future__ import annotations

from ray_forge.weights.base import StoreSpec
from ray_forge.weights.store import WeightStore


class WeightReceiverExtension:
    def pull_weights(self, spec: StoreSpec, version: int) -> int:
        """Load ``version`` in place; returns how many tensors were loaded."""
        store = getattr(self, "_rf_store", None)
        if store is None or store.spec != spec:  # keep the client: it caches the controller's handle
            store = self._rf_store = WeightStore(spec)
        loaded = 0

        def counted():
            nonlocal loaded
            for pair in store.iter_state_dict(version):
                loaded += 1
                yield pair

        self.reload_weights(weights_iterator=counted())  # vLLM's Worker.reload_weights
        return loaded
