"""The engine's side of a weight sync: the policy actor fetches a version, each vLLM worker loads it.

``EngineWeights`` (in the policy actor) asks the store for a version off the engine's step loop,
so generation goes on while the version is published and, where the transport can hold the bytes
in this process (NIXL's registered buffers, a push's staging), while they travel. Then, between
two engine steps, the worker extension below (vLLM mixes it into its workers:
``worker_extension_cls``) streams the version into ``reload_weights``, which copies it into the
engine's own (possibly repacked) weights. The actor never asks how the bytes travel.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from ray_forge.weights.base import Manifest, MixedWeights, StoreSpec, controller_name
from ray_forge.weights.layout import tensors_digest
from ray_forge.weights.store import WeightStore

log = logging.getLogger(__name__)


def engine_name() -> str:
    """The calling policy actor's name: a transport that streams into named engines finds it by it."""
    import ray

    name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    return name or ""


class EngineWeights:
    """The policy actor's client of the weight store: one per engine."""

    def __init__(self, llm, member: str) -> None:
        self.llm, self.member = llm, member
        self._store: WeightStore | None = None

    def store(self, spec: StoreSpec) -> WeightStore:
        if self._store is None or self._store.spec != spec:  # keep it: it caches buffers and groups
            self._store = WeightStore(spec)
        return self._store

    def fetch(self, spec: StoreSpec, version: int) -> Manifest | None:
        """Off the step loop: wait for ``version`` and bring it as close to the engine as the
        transport allows. None when it does not come to this engine (a push it was not part of:
        it keeps its weights and takes part in the next)."""
        return self.store(spec).fetch(version, member=self.member)

    def load(self, spec: StoreSpec, manifest: Manifest) -> int:
        """On the step loop: every worker loads the fetched version; returns the tensors loaded.
        A load that fails has begun to overwrite the engine's weights: MixedWeights."""
        try:
            return self.llm.collective_rpc("load_weights", args=(spec, manifest))[0]
        except Exception as err:
            raise MixedWeights(f"loading weights version {manifest.version} from {manifest.sender} into "
                               f"{self.member or 'the engine'} failed part-way: {type(err).__name__}: {err}") from err

    def route(self) -> str:
        """How versions reached this engine, in words (e.g. ``nixl (UCX: cma/memory (intra-node))``)."""
        return "no version yet" if self._store is None else self._store.transport.route()

    @staticmethod
    def latest(store_name: str, timeout_s: float) -> tuple[StoreSpec, int] | None:
        """The store's spec and newest version (for an engine that restarted and must catch up);
        None before any version was published."""
        import ray

        try:
            handle = ray.get_actor(controller_name(store_name))
        except ValueError:
            return None
        return ray.get(handle.latest.remote(), timeout=timeout_s)


class WeightReceiverExtension:
    def _rf_store_for(self, spec: StoreSpec) -> WeightStore:
        store = getattr(self, "_rf_store", None)
        if store is None or store.spec != spec:  # keep the client: it caches the controller's handle
            store = self._rf_store = WeightStore(spec)
        return store

    def load_weights(self, spec: StoreSpec, manifest: Manifest) -> int:
        """Load the fetched version of ``manifest`` in place; returns how many tensors were loaded.
        The policy actor fetched it and hands over the manifest: a tensor-parallel engine's
        workers are plain processes, without Ray."""
        loaded = self._rf_reload(self._rf_store_for(spec).iter_manifest(manifest))
        self._rf_loaded = manifest.without_locations()  # keeps none of its bytes alive in the sender
        return loaded

    def weights_digest(self) -> str | None:
        """Digest (names, dtypes, shapes and bytes of the whole tensors) of the last version this
        worker loaded, read again from this process's copy (transports that fetch into the process:
        nixl, collective); None before any load, or without such a copy. What the engine computes
        with it is checked by comparing logits."""
        manifest = getattr(self, "_rf_loaded", None)
        if manifest is None or not self._rf_store.transport.holds(manifest):
            return None
        return tensors_digest(self._rf_store.iter_manifest(manifest))

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
