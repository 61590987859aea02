"""What a rollout is told: its games' seeds, its episode rules and its timeouts.

The game loop itself is ``ray_forge.core.play``; the env actors run it (``EnvPool.play``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_forge.config.schema import JobConfig
from ray_forge.core.play import EpisodeRules


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
    rules: EpisodeRules = field(default_factory=EpisodeRules)
    """How a game is shown to the model and what ends it early."""
    max_model_len: int = 128
    """The engines' longest sequence: no episode grows past it."""

    @classmethod
    def of(cls, config: JobConfig) -> RolloutSettings:
        """A run's rollouts, as its config says."""
        episode = config.env.episode
        # The turn limit and the penalty are this rollout's own (``episode_rules``).
        rules = EpisodeRules(mode=episode.mode, turn_tokens=config.policy.max_tokens,
                             episode_tokens=episode.max_tokens or config.policy.max_model_len,
                             strict_template=episode.strict_template, tools=episode.tools)
        return cls(group_size=config.grpo.samples_per_prompt, max_turns=config.env.max_turns,
                   invalid_action_penalty=config.env.invalid_action_penalty,
                   policy_timeout_s=config.policy.call_timeout_s, env_timeout_s=config.env.call_timeout_s,
                   rules=rules, max_model_len=config.policy.max_model_len)

    def episode_rules(self) -> EpisodeRules:
        """The rules, with this rollout's own turn limit and penalty (a test or a bench may set those alone)."""
        import dataclasses

        return dataclasses.replace(self.rules, max_turns=self.max_turns, penalty=self.invalid_action_penalty)

    @property
    def play_limit_s(self) -> float:
        """Longest a chunk's play may take when every turn's policy and env calls use their whole
        timeouts: the backstop of waits on a whole play."""
        return (self.max_turns + 1) * (self.policy_timeout_s + self.env_timeout_s)


def batch_groups(run_seed: int, batch: int, num_groups: int) -> list[tuple[int, int]]:
    """(group id, seed) of every group of rollout batch ``batch``: fixed by the run's seed, so a
    replayed or resumed batch deals the same cards."""
    return [(gid, run_seed * 1_000_003 + gid) for gid in range(batch * num_groups, (batch + 1) * num_groups)]


def request_seed(groups: list[tuple[int, int]], turn: int) -> int:
    """Sampling seed of one turn of a batch: fixed by its games, so a replayed or resumed batch
    draws the same completions from the same weights."""
    return (groups[0][1] * 7919 + len(groups) * 104729 + turn) % 2**62 if groups else turn
