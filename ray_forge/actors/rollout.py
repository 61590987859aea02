"""Rollouts: env observations become prompts, completions become actions, finished games Episodes.

Takes the policy as an actor handle and the envs through a small interface (``RemoteEnvs`` for an
env pool actor, ``LocalEnvs`` for the pool of the rollout worker it runs in), so tests can drive it
with plain objects wrapped in Ray or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass

from ray_forge.config.schema import JobConfig
from ray_forge.core.env import StepResult
from ray_forge.core.episode import Episode, Turn
from ray_forge.remote import RemoteCallError, call


@dataclass(frozen=True)
class RolloutSettings:
    group_size: int
    max_turns: int
    invalid_action_penalty: float
    policy_timeout_s: float
    env_timeout_s: float
    greedy: bool = False
    """Play the policy's most likely completion instead of sampling (evaluation)."""
    priority: int = 0
    """The engine schedules waiting requests of a lower priority first (evaluations: -1)."""

    @classmethod
    def of(cls, config: JobConfig) -> RolloutSettings:
        """A run's rollouts, as its config says."""
        return cls(group_size=config.grpo.group_size, max_turns=config.env.max_turns,
                   invalid_action_penalty=config.env.invalid_action_penalty,
                   policy_timeout_s=config.policy.call_timeout_s, env_timeout_s=config.env.call_timeout_s)

    @property
    def play_limit_s(self) -> float:
        """Longest a chunk's play may take when every turn's policy and env calls use their whole
        timeouts: the backstop of waits on a whole play."""
        return (self.max_turns + 1) * (self.policy_timeout_s + self.env_timeout_s)


def batch_groups(run_seed: int, batch: int, num_groups: int) -> list[tuple[int, int]]:
    """(group id, seed) of every group of rollout batch ``batch``: fixed by the run's seed, so a
    replayed or resumed batch deals the same cards."""
    return [(gid, run_seed * 1_000_003 + gid) for gid in range(batch * num_groups, (batch + 1) * num_groups)]


class RemoteEnvs:
    """An env pool actor, every call under the rollout's env timeout."""

    def __init__(self, handle, name: str, timeout_s: float) -> None:
        self.handle, self.name, self.timeout_s = handle, name, timeout_s

    async def reset(self, key: Hashable, seeds: list[int]) -> list[StepResult]:
        return await call(self.handle.reset.remote(key, seeds), timeout_s=self.timeout_s, what=f"{self.name}.reset")

    async def step(self, key: Hashable, slots: list[int], actions: list[str]) -> list[StepResult]:
        return await call(self.handle.step.remote(key, slots, actions), timeout_s=self.timeout_s,
                          what=f"{self.name}.step")

    def release(self, key: Hashable) -> None:
        self.handle.release.remote(key)


class LocalEnvs:
    """An env pool in this process; its calls run on a thread, so the games of other batches
    (and their policy calls) go on while envs step, each under the rollout's env timeout."""

    def __init__(self, pool, name: str, timeout_s: float) -> None:
        self.pool, self.name, self.timeout_s = pool, name, timeout_s

    async def reset(self, key: Hashable, seeds: list[int]) -> list[StepResult]:
        return await self._timed("reset", self.pool.reset, key, seeds)

    async def step(self, key: Hashable, slots: list[int], actions: list[str]) -> list[StepResult]:
        return await self._timed("step", self.pool.step, key, slots, actions)

    async def _timed(self, what: str, fn, *args):
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.timeout_s)
        except asyncio.TimeoutError:
            raise RemoteCallError(f"{self.name}.{what} did not answer within {self.timeout_s:.0f}s",
                                  f"{self.name}.{what}") from None

    def release(self, key: Hashable) -> None:
        self.pool.release(key)


def request_seed(groups: list[tuple[int, int]], turn: int) -> int:
    """Sampling seed of one turn of a batch: fixed by its games, so a replayed or resumed batch
    draws the same completions from the same weights."""
    return (groups[0][1] * 7919 + len(groups) * 104729 + turn) % 2**62 if groups else turn


async def play_groups(policy, policy_name: str, envs: RemoteEnvs | LocalEnvs, groups: list[tuple[int, int]],
                      settings: RolloutSettings, key: Hashable = 0) -> list[list[Episode]]:
    """Play ``group_size`` games per (group_id, seed), all dealt from that seed, to the end.

    ``key`` names this batch in the env pool, so concurrent batches can share one pool.
    Every turn sends all unfinished games' prompts to the policy in one batch and all their
    actions to the env pool in one call. Games still running after ``max_turns`` end with the
    invalid-action penalty, so a model that never stops cannot stall the rollout.
    """
    games = [(gid, seed) for gid, seed in groups for _ in range(settings.group_size)]
    try:
        starts = await envs.reset(key, [seed for _, seed in games])
        observations = [start.observation for start in starts]
        turns: list[list[Turn]] = [[] for _ in games]
        rewards = [start.reward for start in starts]
        errors: list[str | None] = [start.info.get("error") for start in starts]
        active = [slot for slot, start in enumerate(starts) if not start.done]
        for turn in range(settings.max_turns):
            if not active:
                break
            completions: list[Turn] = await call(
                policy.generate.remote([observations[i] for i in active], settings.greedy,
                                       request_seed(groups, turn), settings.priority),
                timeout_s=settings.policy_timeout_s, what=f"{policy_name}.generate")
            results = await envs.step(key, active, [c.text for c in completions])
            still_active = []
            for slot, completion, result in zip(active, completions, results, strict=True):
                turns[slot].append(completion)
                rewards[slot] += result.reward
                if result.done:
                    errors[slot] = result.info.get("error")
                else:
                    observations[slot] = result.observation
                    still_active.append(slot)
            active = still_active
    finally:
        envs.release(key)  # also after a failure: the batch is replayed elsewhere
    for slot in active:
        rewards[slot] = settings.invalid_action_penalty
        errors[slot] = f"still playing after {settings.max_turns} turns"
    episodes = [Episode(group_id=gid, seed=seed, turns=tuple(turns[i]), reward=rewards[i], error=errors[i])
                for i, (gid, seed) in enumerate(games)]
    g = settings.group_size
    return [episodes[i:i + g] for i in range(0, len(episodes), g)]
