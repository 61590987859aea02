"""Episodes (what rollouts produce) and samples (what the trainer consumes)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields


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
    """The decoded response, as the engine's detokenizer gave it (what a ``turns`` env parses; a
    ``sequence`` env reads ``ChatFormat.decode`` of the ids)."""
    token_versions: tuple[int, ...] = ()
    """The policy version that sampled each response token: a weight update can land while a
    completion is being generated (empty: all tokens are ``policy_version``'s)."""

    def versions(self) -> tuple[int, ...]:
        return self.token_versions or (self.policy_version,) * len(self.response_ids)


@dataclass(frozen=True)
class Segment:
    """One token sequence as the engine saw it: what the chat template rendered (prompts, tool
    results, observations: no loss) and what the engine sampled (loss), in order.

    A multi-turn episode is one segment, unless the template rewrote earlier turns (then a new
    segment starts from the template's own rendering: see ``ray_forge.core.sequence``)."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    """1 exactly on the tokens the engine sampled, 0 on every token it was given."""
    logprobs: tuple[float, ...]
    """Behaviour logprob of each sampled token, in order."""
    token_versions: tuple[int, ...]
    """The policy version that sampled each sampled token, in order."""

    def __post_init__(self) -> None:
        sampled = sum(self.loss_mask)
        if len(self.loss_mask) != len(self.token_ids) or not len(self.logprobs) == len(self.token_versions) == sampled:
            raise ValueError(f"segment of {len(self.token_ids)} tokens has a mask of {len(self.loss_mask)}, "
                             f"{sampled} sampled tokens, {len(self.logprobs)} logprobs and "
                             f"{len(self.token_versions)} versions")

    @classmethod
    def of_turn(cls, turn: Turn) -> Segment:
        """A single-turn segment: the turn's prompt, then its response."""
        return cls(token_ids=turn.prompt_ids + turn.response_ids,
                   loss_mask=(0,) * len(turn.prompt_ids) + (1,) * len(turn.response_ids),
                   logprobs=turn.logprobs, token_versions=turn.versions())


@dataclass(frozen=True)
class Episode:
    """A finished game: its turns, its return, and the GRPO group it belongs to.

    ``segments`` empty: every turn trains as its own sample (a prompt and its response). Else
    the episode trains as its segments: one token sequence per segment, loss on sampled tokens."""

    group_id: int
    seed: int
    turns: tuple[Turn, ...]
    reward: float
    error: str | None = None
    """Why the game ended early (unparseable action, too many turns), if it did."""
    segments: tuple[Segment, ...] = ()
    stats: dict[str, float] = field(default_factory=dict)
    """Counts of the episode's own (tool calls, tool errors, truncation), summed into the step's metrics."""
    tool_latencies_s: tuple[float, ...] = ()
    """How long each of its tool calls took."""
    messages: tuple[dict, ...] = ()
    """A ``sequence`` episode as a chat (user, assistant and tool messages): what a person reads."""

    def __setstate__(self, state: dict) -> None:
        # An episode pickled before a field existed (a checkpoint of an older version) gets its default.
        for f in fields(self):
            if f.name not in state:
                state[f.name] = f.default_factory() if f.default_factory is not MISSING else f.default
        self.__dict__.update(state)

    @property
    def policy_version(self) -> int:
        """The oldest weights that produced any of its turns; staleness is judged by this."""
        return min((t.policy_version for t in self.turns), default=0)

    @property
    def text(self) -> str:
        """The model's completions, joined (what an evaluation shows of a game)."""
        return "".join(t.text for t in self.turns)

    def training_segments(self) -> tuple[Segment, ...]:
        return self.segments or tuple(Segment.of_turn(t) for t in self.turns)


@dataclass
class Sample:
    """One training sequence, the positions with a loss, and the loss terms that weight it."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    """1 on the tokens the engine sampled (the only ones with a loss), 0 elsewhere."""
    behaviour_logprobs: tuple[float, ...]
    """One per sampled token, in order."""
    advantage: float
    policy_version: int
    weight: float = 1.0
    """How many identical samples this row stands for."""
    ref_logprobs: tuple[float, ...] | None = field(default=None)
    token_versions: tuple[int, ...] = ()
    """The policy version that sampled each sampled token (see ``Turn.token_versions``)."""

    @classmethod
    def completion(cls, prompt_ids: tuple[int, ...], response_ids: tuple[int, ...], **fields) -> Sample:
        """A prompt and a sampled response: the loss on the response only."""
        return cls(token_ids=tuple(prompt_ids) + tuple(response_ids),
                   loss_mask=(0,) * len(prompt_ids) + (1,) * len(response_ids), **fields)

    @classmethod
    def of_segment(cls, segment: Segment, advantage: float) -> Sample:
        return cls(token_ids=segment.token_ids, loss_mask=segment.loss_mask, behaviour_logprobs=segment.logprobs,
                   advantage=advantage, policy_version=min(segment.token_versions, default=0),
                   token_versions=segment.token_versions)


def episodes_to_samples(episodes: list[Episode], advantages: list[float]) -> list[Sample]:
    """Every segment of a game (a turn, or a whole multi-turn sequence) is credited with the
    game's advantage (outcome reward)."""
    return [Sample.of_segment(segment, advantage)
            for episode, advantage in zip(episodes, advantages, strict=True)
            for segment in episode.training_segments()]


def merge_identical(samples: list[Sample]) -> list[Sample]:
    """Merge samples with the same tokens, policy version of each token and advantage sign.

    Same tokens and versions mean the same behaviour logprobs, hence the same ratio; for one
    sign, min(r*A, clip(r)*A) is linear in A, so a row with the summed advantage and the
    count as weight gives exactly the loss and gradient of the separate rows.
    """
    merged: dict[tuple, Sample] = {}
    for sample in samples:
        sign = (sample.advantage > 0) - (sample.advantage < 0)
        key = (sample.token_ids, sample.loss_mask, sample.token_versions, sample.policy_version, sign)
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
