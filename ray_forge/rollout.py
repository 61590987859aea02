"""Rollouts: env observations become prompts, completions become actions, finished games Episodes.

Takes actor handles as parameters, so tests can drive it with plain objects wrapped in Ray or not.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_forge.episode import Episode, Turn
from ray_forge.remote import call


@dataclass(frozen=True)
class RolloutSettings:
    group_size: int
    max_turns: int
    invalid_action_penalty: float
    policy_timeout_s: float
    env_timeout_s: float
    greedy: bool = False
    """Play the policy's most likely completion instead of sampling (evaluation)."""


def request_seed(groups: list[tuple[int, int]], turn: int) -> int:
    """Sampling seed of one turn of a batch: fixed by its games, so a replayed or resumed batch
    draws the same completions from the same weights."""
    return (groups[0][1] * 7919 + len(groups) * 104729 + turn) % 2**62 if groups else turn


async def play_groups(policy, policy_name: str, env_pool, env_name: str, groups: list[tuple[int, int]],
                      settings: RolloutSettings, key: int = 0) -> list[list[Episode]]:
    """Play ``group_size`` games per (group_id, seed), all dealt from that seed, to the end.

    ``key`` names this batch in the env pool, so concurrent batches can share one pool.
    Every turn sends all unfinished games' prompts to the policy in one batch and all their
    actions to the env pool in one call. Games still running after ``max_turns`` end with the
    invalid-action penalty, so a model that never stops cannot stall the rollout.
    """
    games = [(gid, seed) for gid, seed in groups for _ in range(settings.group_size)]
    try:
        starts = await call(env_pool.reset.remote(key, [seed for _, seed in games]),
                            timeout_s=settings.env_timeout_s, what=f"{env_name}.reset")
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
                                       request_seed(groups, turn)),
                timeout_s=settings.policy_timeout_s, what=f"{policy_name}.generate")
            results = await call(env_pool.step.remote(key, active, [c.text for c in completions]),
                                 timeout_s=settings.env_timeout_s, what=f"{env_name}.step")
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
        env_pool.release.remote(key)  # also after a failure: the batch is replayed elsewhere
    for slot in active:
        rewards[slot] = settings.invalid_action_penalty
        errors[slot] = f"still playing after {settings.max_turns} turns"
    episodes = [Episode(group_id=gid, seed=seed, turns=tuple(turns[i]), reward=rewards[i], error=errors[i])
                for i, (gid, seed) in enumerate(games)]
    g = settings.group_size
    return [episodes[i:i + g] for i in range(0, len(episodes), g)]
