"""Env pool actor: steps many games at once on a CPU-pool node."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import ray

from ray_forge.env import StepResult, TextEnv

log = logging.getLogger(__name__)


def env_factory(name: str, invalid_action_penalty: float, options: dict | None = None) -> Callable[[], TextEnv]:
    """The env registry (envs never import Ray, so the pool imports them). ``options`` are the
    env's own config section (e.g. ``env.code``)."""
    if name == "blackjack":
        from envs.blackjack import BlackjackTextEnv

        return lambda: BlackjackTextEnv(invalid_action_penalty=invalid_action_penalty)
    if name == "code":
        from envs.code import code_env_factory

        return code_env_factory(**(options or {}))
    raise ValueError(f"unknown env {name!r} (known: blackjack, code)")


class EnvPool:
    """Many concurrent games, grouped in batches by a caller-chosen key.

    ``reset(key, seeds)`` deals a batch; ``step(key, slots, actions)`` advances chosen games of
    it; ``release(key)`` returns its envs for reuse. Batches with different keys never share
    an env, so several rollouts can use one pool at once. An env that raises does not take
    the pool down: that game ends with the penalty and the error is reported in ``info``.
    """

    def __init__(self, name: str, invalid_action_penalty: float = -1.0, options: dict | None = None) -> None:
        self._make = env_factory(name, invalid_action_penalty, options)
        self._penalty = invalid_action_penalty
        self._batches: dict[int, list[TextEnv]] = {}
        self._free: list[TextEnv] = []
        self.action_words = self._make().action_words
        # Envs that wait on execution (code) step in parallel; cheap envs step in this thread.
        concurrency = (options or {}).get("concurrency", 1)
        self._threads = ThreadPoolExecutor(concurrency) if concurrency > 1 else None

    def reset(self, key: int, seeds: list[int]) -> list[str]:
        self.release(key)
        envs = [self._free.pop() if self._free else self._make() for _ in seeds]
        self._batches[key] = envs
        return [env.reset(seed) for env, seed in zip(envs, seeds)]

    def step(self, key: int, slots: list[int], actions: list[str]) -> list[StepResult]:
        envs = self._batches[key]

        def one(slot: int, action: str) -> StepResult:
            try:
                return envs[slot].step(action)
            except Exception as err:  # a broken game must not kill the other games
                log.warning("env %s slot %d failed on %r: %s", key, slot, action[:80], err)
                return StepResult("", self._penalty, True, {"error": f"env error: {err}"})

        if len(slots) != len(actions):
            raise ValueError(f"{len(slots)} slots but {len(actions)} actions")
        if self._threads is None:
            return [one(slot, action) for slot, action in zip(slots, actions)]
        return list(self._threads.map(one, slots, actions))

    def release(self, key: int) -> None:
        self._free.extend(self._batches.pop(key, []))

    def get_action_words(self) -> tuple[str, ...] | None:
        return self.action_words

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


EnvPoolActor = ray.remote(EnvPool)
