"""Episodes (what rollouts produce) and samples (what the trainer consumes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Turn:
    """One decision: the prompt the policy saw, what it generated, and with which weights.

    The policy returns one per prompt; a game keeps one per move."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Behaviour logprob of each response token, as reported by the engine."""
    policy_version: int
    """The oldest weights that sampled any of its tokens."""
    text: str = ""
    """The decoded response (what the env parsed)."""
    token_versions: tuple[int, ...] = ()
    """The policy version that sampled each response token: a weight update can land while a
    completion is being generated (empty: all tokens are ``policy_version``'s)."""

    def versions(self) -> tuple[int, ...]:
        return self.token_versions or (self.policy_version,) * len(self.response_ids)


@dataclass(frozen=True)
class Episode:
    """A finished game: its turns, its return, and the GRPO group it belongs to."""

    group_id: int
    seed: int
    turns: tuple[Turn, ...]
    reward: float
    error: str | None = None
    """Why the game ended early (unparseable action, too many turns), if it did."""

    @property
    def policy_version(self) -> int:
        """The oldest weights that produced any of its turns; staleness is judged by this."""
        return min((t.policy_version for t in self.turns), default=0)


@dataclass
class Sample:
    """One training sequence: prompt + response tokens, and the loss terms that weight it."""

    token_ids: tuple[int, ...]
    prompt_len: int
    behaviour_logprobs: tuple[float, ...]
    advantage: float
    policy_version: int
    weight: float = 1.0
    """How many identical samples this row stands for."""
    ref_logprobs: tuple[float, ...] | None = field(default=None)
    token_versions: tuple[int, ...] = ()
    """The policy version that sampled each response token (see ``Turn.token_versions``)."""


def episodes_to_samples(episodes: list[Episode], advantages: list[float]) -> list[Sample]:
    """Every turn of a game is credited with the game's advantage (outcome reward)."""
    samples = []
    for episode, advantage in zip(episodes, advantages, strict=True):
        for turn in episode.turns:
            samples.append(
                Sample(
                    token_ids=turn.prompt_ids + turn.response_ids,
                    prompt_len=len(turn.prompt_ids),
                    behaviour_logprobs=turn.logprobs,
                    advantage=advantage,
                    policy_version=turn.policy_version,
                    token_versions=turn.versions(),
                )
            )
    return samples


def merge_identical(samples: list[Sample]) -> list[Sample]:
    """Merge samples with the same tokens, policy version of each token and advantage sign.

    Same tokens and versions mean the same behaviour logprobs, hence the same ratio; for one
    sign, min(r*A, clip(r)*A) is linear in A, so a row with the summed advantage and the
    count as weight gives exactly the loss and gradient of the separate rows.
    """
    merged: dict[tuple, Sample] = {}
    for sample in samples:
        sign = (sample.advantage > 0) - (sample.advantage < 0)
        key = (sample.token_ids, sample.token_versions, sample.policy_version, sign)
        if key in merged:
            row = merged[key]
            row.advantage += sample.advantage
            row.weight += sample.weight
        else:
            merged[key] = Sample(**{**sample.__dict__})
    return list(merged.values())


@dataclass(frozen=True)
class Scored:
    """The trainer's view of one (prompt, response): each response token's logprob, and the
    argmax token at the first response position."""

    logprobs: tuple[float, ...]
    argmax: int
