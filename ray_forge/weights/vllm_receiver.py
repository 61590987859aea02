"""The store's vLLM-side hook: a worker extension, so each vLLM worker takes weights itself.

vLLM mixes this class into its workers (``worker_extension_cls``); the policy actor reaches it
with ``collective_rpc(...)``. Pull transports: ``pull_weights`` streams the store's buckets
straight into ``reload_weights``, which copies them into the engine's own (possibly repacked)
weights. The collective (push) transport takes two calls, so that an engine is never left half
updated: ``receive_weights`` receives every bucket into staging on every worker, and only when
all of them have everything does ``load_received`` load it.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from ray_forge.weights.base import Manifest, StoreSpec, WeightSyncError
from ray_forge.weights.store import WeightStore

log = logging.getLogger(__name__)


def engine_name() -> str:
    """The calling policy actor's name (``policy-<i>``): a collective push gives each named engine its ranks."""
    import ray

    name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    return name or ""


def receive_pushed(llm, spec: StoreSpec, version: int, current_version: int) -> bool:
    """In the policy actor: every worker of ``llm`` receives ``version`` into staging, then, only
    once all have it, loads it. False when this engine is not part of that push (it restarted
    meanwhile and takes part in the next). A failed transfer raises WeightSyncError and leaves
    the engine on ``current_version``."""
    name = engine_name()
    try:
        received = llm.collective_rpc("receive_weights", args=(spec, version, name))
    except WeightSyncError as err:
        raise WeightSyncError(f"{name} keeps weights version {current_version}: {err}") from None
    if any(r is None for r in received):
        log.warning("%s was not part of the push of version %d; it keeps version %d until the next push",
                    name, version, current_version)
        return False
    llm.collective_rpc("load_received", args=(version,))
    return True


class WeightReceiverExtension:
    def _rf_store_for(self, spec: StoreSpec) -> WeightStore:
        store = getattr(self, "_rf_store", None)
        if store is None or store.spec != spec:  # keep the client: it caches the controller's handle (and groups)
            store = self._rf_store = WeightStore(spec)
        return store

    def pull_weights(self, spec: StoreSpec, manifest: Manifest) -> int:
        """Load the version of ``manifest`` in place; returns how many tensors were loaded. The
        policy actor asks the controller for the manifest: a tensor-parallel engine's workers are
        plain processes, without Ray."""
        return self._rf_reload(self._rf_store_for(spec).iter_manifest(manifest))

    def receive_weights(self, spec: StoreSpec, version: int, engine: str) -> int | None:
        """Collective transport, step 1: receive every bucket of ``version`` into staging (the
        engine keeps serving its current weights). Returns the bytes received, or None when this
        engine is not part of that push (it was restarting when the push began)."""
        if engine not in spec.receivers:
            raise WeightSyncError(f"engine {engine!r} is not one of the push's receivers {list(spec.receivers)}")
        store = self._rf_store_for(spec)
        self._rf_staged = None  # the staging buffers are about to be overwritten
        self._rf_staged = store.transport.receive(store, version, engine, worker=getattr(self, "rank", 0))
        return None if self._rf_staged is None else self._rf_staged.manifest.nbytes

    def load_received(self, version: int) -> int:
        """Collective transport, step 2: load the staged ``version`` in place; returns how many
        tensors were loaded."""
        staged = getattr(self, "_rf_staged", None)
        if staged is None or staged.manifest.version != version:
            raise WeightSyncError(f"weights version {version} was not received into staging on this worker")
        return self._rf_reload(staged)

    def weights_digest(self) -> str | None:
        """Digest of the last version received over the collective transport, as it was staged
        and handed to ``reload_weights`` (names, dtypes, shapes and bytes of the whole tensors);
        None before any. What the engine computes with it is checked by comparing logits."""
        from ray_forge.weights.collective import tensors_digest

        staged = getattr(self, "_rf_staged", None)
        return None if staged is None else tensors_digest(staged)

    def _rf_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        loaded = 0

        def counted():
            nonlocal loaded
            for pair in weights:
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
