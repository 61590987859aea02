"""One episode as one token sequence, token in, token out.

The builder keeps the ids the engine is given and the ids it sampled, in order. A model turn is
appended exactly as sampled (never decoded and encoded again: a tokenizer may not give the same
ids back); an env turn (tool results, an observation) is rendered by the chat template and only
its new tokens are appended. The loss mask is 1 exactly on sampled tokens.

Appending is sound only while the template renders the conversation before the model's last turn
as it did when that turn was generated, and keeps what the model wrote in it. Some templates
rewrite earlier turns (Qwen3 drops an earlier answer's reasoning once a new user turn follows).
Then the builder starts a new segment from the template's rendering of the whole conversation, and
counts it; with ``strict`` it raises :class:`TemplateRewrite` naming the turn. Either way no
trained token is one the engine did not see. One rendering per env turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_forge.core.chat import THINK_CLOSE, THINK_OPEN, ChatFormat, assistant_message
from ray_forge.core.episode import Segment, Turn


class TemplateRewrite(RuntimeError):
    """The chat template changed earlier turns when a message was added (strict mode)."""


@dataclass
class _Open:
    """The segment being built."""

    ids: list[int]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mask = [0] * len(self.ids)

    def given(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)

    def sampled(self, turn: Turn) -> None:
        self.ids += turn.response_ids
        self.mask += [1] * len(turn.response_ids)
        self.logprobs += turn.logprobs
        self.versions += turn.versions()

    def close(self) -> Segment:
        """The segment up to its last sampled token: what follows it (an env's last reply, the
        next prompt) carries no loss and predicts nothing that does."""
        end = len(self.mask) - self.mask[::-1].index(1) if 1 in self.mask else len(self.mask)
        return Segment(tuple(self.ids[:end]), tuple(self.mask[:end]), tuple(self.logprobs), tuple(self.versions))


class SequenceBuilder:
    """``prompt()`` is what the engine is given next; ``add_model_turn`` appends what it sampled;
    ``add_env_turn`` appends the env's reply; ``segments()`` is what the trainer gets."""

    def __init__(self, chat: ChatFormat, messages: list[dict], strict: bool = False) -> None:
        self.chat, self.strict = chat, strict
        self.messages = list(messages)
        self._rendered = chat.render(self.messages, add_generation_prompt=True)
        """The template's rendering of the conversation up to the prompt of the next model turn."""
        self._open = _Open(list(self._rendered))
        self._done: list[Segment] = []
        self.model_turns = 0
        self._last: tuple[Turn, str] | None = None

    def prompt(self) -> tuple[int, ...]:
        return tuple(self._open.ids)

    def __len__(self) -> int:
        return len(self._open.ids)

    def add_model_turn(self, turn: Turn, text: str) -> dict:
        """Append ``turn``'s sampled ids as they are; ``text`` (their decoding) becomes the
        assistant message the template renders later turns against. Returns that message."""
        if turn.prompt_ids != self.prompt():
            raise ValueError("the turn was generated from another prompt than this sequence's")
        self._open.sampled(turn)
        self.model_turns += 1
        message = assistant_message(text)
        self.messages.append(message)
        self._last = (turn, text)
        return message

    def add_env_turn(self, new: list[dict]) -> bool:
        """Append the template's rendering of ``new`` (tool results, an observation) and the next
        generation prompt. Returns False when a new segment had to start (the template rewrote an
        earlier turn); raises :class:`TemplateRewrite` instead in strict mode."""
        if self._last is None:
            raise ValueError("an env turn must follow a model turn")
        turn, text = self._last
        base, after = self._rendered, self.chat.render(self.messages + new, add_generation_prompt=True)
        self.messages += new
        self._rendered, self._last = after, None
        # The template renders the model's own last turn its own way (Qwen3 adds an empty reasoning
        # block to the last assistant turn only): what must hold is the conversation before it,
        # and every reasoning block the model wrote.
        end = _end_of_turn(after, len(base), self.chat.end_of_turn) if after[:len(base)] == base else None
        if end is None or not _keeps_reasoning(self.chat, text, after[len(base):end]):
            if self.strict:
                raise TemplateRewrite(f"model turn {self.model_turns}: the chat template renders the earlier turns "
                                      "differently once this message is added, so the episode cannot stay one "
                                      "token sequence (set env.episode.strict_template=false to start a new "
                                      "segment instead)")
            self._done.append(self._open.close())
            self._open = _Open(list(after))
            return False
        # After the model's last sampled token: the end of turn when the engine stopped elsewhere
        # (at the end of a tool call, or at the token limit), then what the template puts after it
        # (a newline) and the new messages; none of which the engine sampled.
        ended = bool(turn.response_ids) and turn.response_ids[-1] == self.chat.end_of_turn
        self._open.given(([] if ended else [self.chat.end_of_turn]) + after[end + 1:])
        return True

    def segments(self) -> tuple[Segment, ...]:
        """Every segment with at least one sampled token (the others train nothing)."""
        return tuple(s for s in (*self._done, self._open.close()) if any(s.loss_mask))

    @property
    def num_segments(self) -> int:
        """Segments that train something."""
        return len(self.segments())


def _end_of_turn(ids: list[int], start: int, end_of_turn: int) -> int | None:
    """Where the assistant turn that starts at ``start`` ends, or None (a template that does not end it)."""
    try:
        return ids.index(end_of_turn, start)
    except ValueError:
        return None


def _keeps_reasoning(chat: ChatFormat, text: str, rendered: list[int]) -> bool:
    """Whether the template's rendering of the model's turn still holds the reasoning the model
    wrote (``<think>...</think>``): Qwen3's drops it once a new user query follows."""
    if THINK_CLOSE not in text:
        return True
    reasoning = text.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1].strip()
    return not reasoning or reasoning in chat.tokenizer.decode(rendered, skip_special_tokens=False)
