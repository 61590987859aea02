"""The store's controller actor: which versions exist and where they live (TorchStore's role)."""

from __future__ import annotations

import asyncio

import ray

from ray_forge.weights.base import Manifest, StoreSpec


class WeightStoreController:
    """Holds the manifest of each live version. For the object-store transport the manifests hold
    the bucket refs, so dropping a manifest here is what frees that version's memory."""

    def __init__(self) -> None:
        self.manifests: dict[int, Manifest] = {}
        self.published: dict[int, asyncio.Event] = {}
        self.spec: StoreSpec | None = None

    def _event(self, version: int) -> asyncio.Event:
        return self.published.setdefault(version, asyncio.Event())

    async def publish(self, manifest: Manifest, keep_versions: int, spec: StoreSpec | None = None) -> list[Manifest]:
        """Record a version; returns the manifests evicted to keep at most ``keep_versions``."""
        self.spec = spec or self.spec
        self.manifests[manifest.version] = manifest
        self._event(manifest.version).set()
        evicted = [self.manifests.pop(v) for v in sorted(self.manifests)[:-keep_versions]]
        for old in evicted:
            self.published.pop(old.version, None)
        return evicted

    async def manifest(self, version: int, timeout_s: float) -> Manifest | None:
        """The version's manifest, waiting up to ``timeout_s`` for it to be published; None if it
        was not published in time or was already evicted."""
        if version not in self.manifests and self.manifests and version < max(self.manifests):
            return None  # older than every live version: evicted, it will never come back
        try:
            await asyncio.wait_for(self._event(version).wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            return None
        return self.manifests.get(version)

    async def latest(self) -> tuple[StoreSpec, int] | None:
        """The store's spec and newest version, for a receiver that restarted and must catch up."""
        if not self.manifests or self.spec is None:
            return None
        return self.spec, max(self.manifests)

    async def versions(self) -> list[int]:
        return sorted(self.manifests)

    async def delete(self, version: int) -> Manifest | None:
        self.published.pop(version, None)
        return self.manifests.pop(version, None)


ControllerActor = ray.remote(num_cpus=0)(WeightStoreController)
