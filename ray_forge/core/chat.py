"""Chat messages as token ids: the model's own chat template, tool calls in Qwen3's format.

Messages are dicts with a ``role`` (system, user, assistant, tool) and ``content``; an assistant
message may carry ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``).
The assistant writes a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, and the
template shows results as ``<tool_response>...</tool_response>`` (how Qwen3 models are trained).

Only the template renders: a model folder's own (``tokenizer_config.json`` / ``chat_template.jinja``),
or, for the tiny model made locally, :data:`TINY_TEMPLATE`, written in the same format. The
sequence builder (``ray_forge.core.sequence``) renders new messages only; the tokens the engine
sampled are never decoded and encoded again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<tool_response>", "</tool_response>")
"""The tokens a chat tokenizer needs whole; ``<|im_end|>`` ends a turn."""
END_OF_TURN = "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# Qwen3's format without its reasoning blocks (a tiny model does not think): a system turn that
# lists the tools, assistant tool calls as JSON in <tool_call> tags, and consecutive tool results
# in one user turn of <tool_response> blocks. It only appends: no earlier turn changes when a
# message is added, so a whole episode is one token sequence. (Transformers renders templates
# with trim_blocks, which drops a newline right after a tag: those are written as {{ '\n' }}.)
def chatml_template(default_system: str = "") -> str:
    """That format as a chat template; ``default_system``: the system turn shown when the chat has
    none (a ChatML model's own, such as SmolLM2's)."""
    return (
        "{% set system = messages[0].content if messages[0].role == 'system' else " + json.dumps(default_system)
        + " %}"
        "{% if tools %}<|im_start|>system\n"
        "{% if system %}{{ system }}\n\n{% endif %}"
        "# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
        "Call a tool as <tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call><|im_end|>\n"
        "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>\n"
        "{% endif %}"
        "{% for message in messages %}"
        "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
        "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
        "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
        "{% for call in message.tool_calls or [] %}"
        "{% set call = call.function if call.function is defined else call %}"
        "<tool_call>{\"name\": \"{{ call.name }}\", \"arguments\": "
        "{{ call.arguments if call.arguments is string else call.arguments | tojson }}}</tool_call>"
        "{% endfor %}<|im_end|>\n"
        "{% elif message.role == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
        "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
        "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


TINY_TEMPLATE = chatml_template()

TINY_TEMPLATE_TEXT = ("system user assistant tool\n# Tools\n<tools>\n</tools>\n"
                      'Call a tool as {"name": <name>, "arguments": <object>}\n')
"""The words :data:`TINY_TEMPLATE` writes itself: a tiny tokenizer learns them whole."""

_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class Stops:
    """Where the engine ends a turn: at one of ``ids`` (single tokens), or once its text holds one
    of ``texts`` (a tag the tokenizer spells in several tokens, which may come in any split). The
    token that completes a stop is kept, as sampled."""

    ids: tuple[int, ...] = ()
    texts: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.ids or self.texts)


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, or lacks a token the format needs whole."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: its tool and arguments, or why it could not be read."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None
    """Set when the call is unusable (its JSON is malformed, it was cut off): the model is told."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in an assistant turn; a call cut off before its
    closing tag, or whose JSON is not ``{"name": str, "arguments": object}``, has an ``error``."""
    calls = []
    for match in _CALL.finditer(text):
        body, closed = match.group(1), match.group(0).endswith(TOOL_CALL_CLOSE)
        if not closed:
            calls.append(ToolCall("", {}, "the tool call was cut off before </tool_call>"))
            continue
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as err:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({str(err)[:80]})"))
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and isinstance(obj.get("arguments", {}), dict)):
            calls.append(ToolCall("", {}, 'a tool call must be {"name": <string>, "arguments": <object>}'))
            continue
        calls.append(ToolCall(obj["name"], obj.get("arguments", {})))
    return calls


def assistant_message(text: str) -> dict:
    """The assistant turn ``text`` as a message: the text before its first tool call as content,
    and the calls that parse as ``tool_calls`` (the template renders them its own way)."""
    calls = [c for c in parse_tool_calls(text) if c.error is None]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text.split(TOOL_CALL_OPEN, 1)[0],
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}


class ChatFormat:
    """A tokenizer's chat template, as token ids. Picklable (Ray ships it to the env actors)."""

    def __init__(self, tokenizer, tools: list[dict] | None = None) -> None:
        """``tools``: the JSON schemas the template lists in its system turn (OpenAI's shape)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template: a multi-turn episode needs the model's own "
                                    "(tokenizer_config.json's chat_template, or chat_template.jinja)")
        vocab = tokenizer.get_vocab()
        if END_OF_TURN not in vocab:
            raise ChatTemplateError(f"the tokenizer has no single token for {END_OF_TURN}: the engine could not stop at "
                                    "the end of a turn")
        self.tokenizer, self.tools = tokenizer, tools or None
        self.end_of_turn = vocab[END_OF_TURN]
        self.tool_tags = "tokens" if all(t in vocab for t in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)) else "text"
        """How the tool-call tags are written: as tokens of their own (a folder that added them), or
        as text in the model's own vocabulary."""
        close = (vocab[TOOL_CALL_CLOSE],) if self.tool_tags == "tokens" else ()
        self.stops = Stops(ids=(*close, self.end_of_turn), texts=() if close else (TOOL_CALL_CLOSE,))
        """The engine stops at the end of a tool call and at the end of a turn."""

    def stopped(self, ids: tuple[int, ...] | list[int]) -> bool:
        """Whether a turn's sampled ``ids`` end where the engine stops (the end of a turn or of a
        tool call), not at a token limit: its last token is a stop, or completes a stop's text."""
        if not ids:
            return False
        if ids[-1] in self.stops.ids:
            return True
        for text in self.stops.texts:
            tail = list(ids[-(len(text) + 1):])  # each character of a tag takes at most one token
            before = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
            if text in self.tokenizer.decode(tail, skip_special_tokens=False)[max(0, len(before) - len(text) + 1):]:
                return True
        return False

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def decode(self, ids: tuple[int, ...]) -> str:
        """What the env reads of an assistant turn: its text, tool-call tags kept, end of turn dropped."""
        if ids and ids[-1] == self.end_of_turn:
            ids = ids[:-1]
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def text_prompt_ids(tokenizer, chat: bool, system: str | None = None) -> Callable[[str], tuple[int, ...]]:
    """How a text prompt becomes the ids an engine is given: as it is, or (``chat``) as a user turn
    of the tokenizer's chat template and its generation prompt, after ``system``'s turn (None: the
    template's default; empty: none). Raises :class:`ChatTemplateError` for a chat without a template."""
    if not chat:
        return lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))
    form = ChatFormat(tokenizer)
    before = [] if system is None else [{"role": "system", "content": system}]
    return lambda text: tuple(form.render([*before, {"role": "user", "content": text}], add_generation_prompt=True))
