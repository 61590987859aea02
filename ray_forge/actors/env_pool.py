"""Env pool actor: steps many games at once on a CPU-pool node."""

from __future__ import annotations

import logging

import ray

from ray_forge.env import StepResult, TextEnv

log = logging.getLogger(__name__)


def make_env(name: str, invalid_action_penalty: float) -> TextEnv:
    """The env registry (envs never import Ray, so the pool imports them)."""
    if name == "blackjack":
        from envs.blackjack import BlackjackTextEnv

        return BlackjackTextEnv(invalid_action_penalty=invalid_action_penalty)
    raise ValueError(f"unknown env {name!r} (known: blackjack)")


class EnvPool:
    """Many concurrent games, grouped in batches by a caller-chosen key.

    ``reset(key, seeds)`` deals a batch; ``step(key, slots, actions)`` advances chosen games of
    it; ``release(key)`` returns its envs for reuse. Batches with different keys never share
    an env, so several rollouts can use one pool at once. An env that raises does not take
    the pool down: that game ends with the penalty and the error is reported in ``info``.
    """

    def __init__(self, name: str, invalid_action_penalty: float = -1.0) -> None:
        self._name = name
        self._penalty = invalid_action_penalty
        self._batches: dict[int, list[TextEnv]] = {}
        self._free: list[TextEnv] = []
        self.action_words = make_env(name, invalid_action_penalty).action_words

    def reset(self, key: int, seeds: list[int]) -> list[str]:
        self.release(key)
        envs = [self._free.pop() if self._free else make_env(self._name, self._penalty) for _ in seeds]
        self._batches[key] = envs
        return [env.reset(seed) for env, seed in zip(envs, seeds)]

    def step(self, key: int, slots: list[int], actions: list[str]) -> list[StepResult]:
        envs = self._batches[key]
        results = []
        for slot, action in zip(slots, actions, strict=True):
            try:
                results.append(envs[slot].step(action))
            except Exception as err:  # a broken game must not kill the other games
                log.warning("env %s slot %d failed on %r: %s", key, slot, action[:80], err)
                results.append(StepResult("", self._penalty, True, {"error": f"env error: {err}"}))
        return results

    def release(self, key: int) -> None:
        self._free.extend(self._batches.pop(key, []))

    def get_action_words(self) -> tuple[str, ...] | None:
        return self.action_words

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


EnvPoolActor = ray.remote(EnvPool)
