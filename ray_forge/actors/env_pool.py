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
    """A slot per concurrent game. ``reset`` deals new games; ``step`` advances chosen slots.

    An env that raises does not take the pool down: that game ends with the penalty and the
    error is reported in ``info``.
    """

    def __init__(self, name: str, invalid_action_penalty: float = -1.0) -> None:
        self._name = name
        self._penalty = invalid_action_penalty
        self._envs: list[TextEnv] = []
        self.action_words = make_env(name, invalid_action_penalty).action_words

    def reset(self, seeds: list[int]) -> list[str]:
        while len(self._envs) < len(seeds):
            self._envs.append(make_env(self._name, self._penalty))
        return [env.reset(seed) for env, seed in zip(self._envs, seeds)]

    def step(self, slots: list[int], actions: list[str]) -> list[StepResult]:
        results = []
        for slot, action in zip(slots, actions, strict=True):
            try:
                results.append(self._envs[slot].step(action))
            except Exception as err:  # a broken game must not kill the other games
                log.warning("env slot %d failed on %r: %s", slot, action[:80], err)
                results.append(StepResult("", self._penalty, True, {"error": f"env error: {err}"}))
        return results

    def get_action_words(self) -> tuple[str, ...] | None:
        return self.action_words

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


EnvPoolActor = ray.remote(EnvPool)
