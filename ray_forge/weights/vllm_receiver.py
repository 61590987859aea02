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
        _refresh_tied_head(self.model_runner.model)
        return loaded


def _refresh_tied_head(model) -> None:
    """A tied output head shares the embedding's weight, but the CPU backend multiplies by a
    packed copy of it (``cpu_linear``) made when the head was processed after loading. A
    reload processes only the layers it loaded, and a tied checkpoint has no ``lm_head``:
    without this the engine kept sampling from the base model's head (wrong tokens after the
    first update). Redo the head's processing from the embedding the reload just wrote."""
    head = getattr(model, "lm_head", None)
    config = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if head is None or not config or not hasattr(head, "quant_method"):
        return
    head.quant_method.process_weights_after_loading(head)
