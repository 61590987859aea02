"""Episodes (what rollouts produce) and samples (what the trainer consumes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from itertools import chain

import numpy as np


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


Answer = tuple[int, tuple[int, ...], tuple[float, ...], tuple[int, ...], str]
"""One completion as an engine reports it: (its prompt's index among the call's distinct prompts,
response ids, logprobs, each token's policy version, text)."""


@dataclass(frozen=True, eq=False)
class Answers(Sequence[Turn]):
    """A policy's completions of one call, in order, as a few flat arrays instead of an object per
    decision: what travels from an engine to a rollout worker (a BlackJack call answers ~600
    decisions on ~60 distinct prompts). It reads as a sequence of ``Turn``, built on access."""

    prompts: tuple[tuple[int, ...], ...]
    """Each distinct prompt's token ids, once."""
    prompt_of: np.ndarray
    """[N] which of ``prompts`` answer i is for."""
    ends: np.ndarray
    """[N] where answer i's tokens end in the flat arrays below (it starts where i - 1 ends)."""
    response_ids: np.ndarray
    logprobs: np.ndarray
    token_versions: np.ndarray
    texts: tuple[str, ...]
    """Each distinct text, once."""
    text_of: np.ndarray
    """[N] which of ``texts`` answer i's is."""

    @classmethod
    def build(cls, prompts: Sequence[tuple[int, ...]], answers: Sequence[Answer]) -> Answers:
        table: dict[str, int] = {}
        text_of = [table.setdefault(a[4], len(table)) for a in answers]
        return cls(prompts=tuple(prompts), prompt_of=np.fromiter((a[0] for a in answers), np.int64, len(answers)),
                   ends=np.cumsum([len(a[1]) for a in answers], dtype=np.int64),
                   response_ids=np.fromiter(chain.from_iterable(a[1] for a in answers), np.int64),
                   logprobs=np.fromiter(chain.from_iterable(a[2] for a in answers), np.float64),
                   token_versions=np.fromiter(chain.from_iterable(a[3] for a in answers), np.int64),
                   texts=tuple(table), text_of=np.asarray(text_of, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.turns()[index]
        return self.turns()[index] if index < 0 else self._turns(index, index + 1)[0]

    def __iter__(self):
        return iter(self.turns())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def turns(self) -> list[Turn]:
        return self._turns(0, len(self))

    def _turns(self, first: int, last: int) -> list[Turn]:
        base = int(self.ends[first - 1]) if first else 0
        starts = [base, *self.ends[first:last].tolist()]
        ids, logprobs, versions = (a[base:starts[-1]].tolist() for a in (self.response_ids, self.logprobs,
                                                                            self.token_versions))
        turns = []
        for i, prompt, text in zip(range(last - first), self.prompt_of[first:last].tolist(),
                                   self.text_of[first:last].tolist()):
            start, end = starts[i] - base, starts[i + 1] - base
            tokens = tuple(versions[start:end])
            turns.append(Turn(prompt_ids=self.prompts[prompt], response_ids=tuple(ids[start:end]),
                              logprobs=tuple(logprobs[start:end]), policy_version=min(tokens, default=-1),
                              text=self.texts[text], token_versions=tokens))
        return turns


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
