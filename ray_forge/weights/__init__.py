"""Versioned weight store: the trainer puts a version, policies load it in place."""

from ray_forge.weights.dir_store import DirWeightStore

__all__ = ["DirWeightStore"]
