"""Supervised fine-tuning data: chat conversations as token rows, packed.

A conversation is ``{"messages": [...]}`` in chat-message form (roles system, user, assistant,
tool; an assistant message may carry ``tool_calls``), one per JSONL line or Parquet row. It is
rendered by the model's chat template through the same sequence builder as a multi-turn
rollout (``ray_forge.core.sequence``): each assistant turn is the template's own rendering of it,
appended as if sampled (loss 1), and everything else is appended as the env's reply would be
(loss 0). So what SFT teaches is exactly the token sequence RL later samples and trains on.

Short rows are packed into rows of at most ``max_tokens``; each keeps its own positions (from 0)
and attends only to itself (``document_ids``), so a packed batch has the loss of the same rows
unpacked.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ray_forge.core.chat import ChatFormat
from ray_forge.core.episode import Turn
from ray_forge.core.sequence import SequenceBuilder

ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A conversation file or line is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Row:
    """One conversation (or one of its segments) as the trainer sees it."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    """1 on the assistant's tokens: the loss of ``token_ids[t]`` is taken where this is 1."""


@dataclass(frozen=True)
class Packed:
    """Rows side by side in one training row: each restarts its positions at 0 and attends only
    to itself."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    positions: tuple[int, ...]
    document_ids: tuple[int, ...]

    @classmethod
    def of(cls, rows: list[Row]) -> Packed:
        ids, mask, positions, docs = [], [], [], []
        for doc, row in enumerate(rows):
            ids += row.token_ids
            mask += row.loss_mask
            positions += range(len(row.token_ids))
            docs += [doc] * len(row.token_ids)
        return cls(tuple(ids), tuple(mask), tuple(positions), tuple(docs))

    @property
    def loss_tokens(self) -> int:
        """Tokens with a loss: each masked token but a document's first (nothing predicts it)."""
        return sum(m for m, p in zip(self.loss_mask, self.positions) if p > 0)


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    tools: list[dict] | None = None
    """The tool schemas its system turn lists (OpenAI's shape), as the env offered them."""


def load_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation in a JSONL or Parquet file (``messages``, and ``tools`` if it offered
    any), checked; raises :class:`DataError`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"conversation file {path} does not exist")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        rows = [(f"{path} row {i + 1}", obj) for i, obj in enumerate(pq.read_table(path).to_pylist())]
    else:
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"{path}:{number}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{number}: not JSON ({err.msg})") from None
    conversations = [Conversation(_messages(obj, where), _tools(obj, where)) for where, obj in rows]
    if not conversations:
        raise DataError(f"conversation file {path} has no conversations")
    return conversations


def _messages(obj, where: str) -> list[dict]:
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: a conversation is {{\"messages\": [...]}} with at least one message")
    messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                for m in messages]  # Parquet's empty fields
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DataError(f"{where}: message {i} needs a role among {ROLES}")
        if not isinstance(message.get("content", ""), str):
            raise DataError(f"{where}: message {i}'s content must be a string")
        message.setdefault("content", "")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing to learn")
    if messages[0]["role"] == "assistant":
        raise DataError(f"{where}: the conversation starts with the assistant; give the prompt first")
    return messages


def _tools(obj: dict, where: str) -> list[dict] | None:
    tools = obj.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):  # Parquet datasets often keep them as a JSON string
        tools = json.loads(tools)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: 'tools' must be a list of function schemas")
    return tools


def render(tokenizer, conversation: Conversation) -> list[Row]:
    """The conversation as the rollout would have built it: one row, or one per segment when the
    template rewrites an earlier turn (Qwen3's dropped reasoning)."""
    chat, messages = ChatFormat(tokenizer, conversation.tools), conversation.messages
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    builder = SequenceBuilder(chat, messages[:first])
    pending: list[dict] = []
    for message in messages[first:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            builder.add_env_turn(pending)
            pending = []
        ids = assistant_ids(chat, builder.messages, message)
        builder.add_model_turn(Turn(builder.prompt(), ids, (0.0,) * len(ids), 0), chat.decode(ids))
    return [Row(s.token_ids, s.loss_mask) for s in builder.segments()]


def assistant_ids(chat: ChatFormat, before: list[dict], message: dict) -> tuple[int, ...]:
    """The template's tokens of ``message`` after the generation prompt of ``before``, up to and
    including its end of turn (or the end of its tool call, where the engine stops): what the
    model would have to sample to write it."""
    prompt = chat.render(before, add_generation_prompt=True)
    whole = chat.render(before + [message], add_generation_prompt=False)
    if whole[:len(prompt)] != prompt:
        raise DataError("the chat template renders an assistant turn in a way that does not follow its "
                        "own generation prompt; it cannot be trained as sampled tokens")
    rest = whole[len(prompt):]
    end = rest.index(chat.end_of_turn) + 1 if chat.end_of_turn in rest else len(rest)
    if end >= 2 and rest[end - 1] == chat.end_of_turn and chat.stopped(rest[:end - 1]):
        end -= 1  # the engine stops at the end of a tool call; the end of turn after it is given, not sampled
    return tuple(rest[:end])


def pack(rows: list[Row], max_tokens: int, together: bool = True) -> list[Packed]:
    """Rows, in order, into as few training rows of at most ``max_tokens`` as a first fit finds
    (``together=False``: each row alone). A row longer than that is refused: it would be cut
    mid-answer."""
    bins: list[list[Row]] = []
    room: list[int] = []
    for row in rows:
        if len(row.token_ids) > max_tokens:
            raise DataError(f"a conversation of {len(row.token_ids)} tokens is longer than data.max_tokens "
                            f"({max_tokens}); raise it or shorten the conversation")
        for i, left in enumerate(room if together else ()):
            if len(row.token_ids) <= left:
                bins[i].append(row)
                room[i] -= len(row.token_ids)
                break
        else:
            bins.append([row])
            room.append(max_tokens - len(row.token_ids))
    return [Packed.of(b) for b in bins]


def split(conversations: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out): a seeded shuffle, the last ``eval_fraction`` held out."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    held = int(round(len(order) * eval_fraction))
    if eval_fraction > 0 and held == 0:
        held = 1
    if held >= len(order):
        raise DataError(f"{len(order)} conversations leave none to train on with data.eval_fraction={eval_fraction}")
    train = [conversations[i] for i in order[:len(order) - held]]
    return train, [conversations[i] for i in order[len(order) - held:]]


def batch_of(num_rows: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The row indices of training step ``step`` (from 1): epochs of seeded shuffles, so a
    resumed run deals the same batches with no state but the step."""
    start = (step - 1) * batch_size
    indices = []
    while len(indices) < batch_size:
        epoch, offset = divmod(start + len(indices), num_rows)
        order = list(range(num_rows))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        indices += order[offset:offset + batch_size - len(indices)]
    return indices
