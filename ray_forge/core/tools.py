"""Tools an agent calls in the middle of an episode, and the limits every call runs under.

A tool is anything with a ``name``, a JSON ``schema`` (what the chat template lists) and
``__call__(arguments) -> str``. An env offers its own (``TextEnv.tools``), bound to the episode: a
``python`` tool keeps one interpreter session per episode. The limits are the run's, never the
model's: a call's timeout, the calls an episode may make, the characters of output it is shown.

Nothing a tool does crashes an episode: a malformed call, an unknown tool, a tool that raises or
does not answer in time becomes an error message to the model and a counted error.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray_forge.config.schema import ToolConfig
from ray_forge.core.chat import ToolCall


class Tool(Protocol):
    name: str
    schema: dict
    """OpenAI's function shape: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    def __call__(self, arguments: dict[str, Any]) -> str:
        """Run the call; what it raises is shown to the model as the call's failure."""
        ...


class ToolError(Exception):
    """The call ran and failed (the code raised, the sandbox stopped it): the model reads the
    message as the call's output, and it counts as ``tool_error_raised``."""


def function_schema(name: str, description: str, parameters: dict[str, Any], required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": parameters,
                                                            "required": required}}}


@dataclass
class ToolStats:
    """One episode's calls: how many, how many failed (by why), and how long each took."""

    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


def _truncated(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[output truncated: {len(text) - limit} of {len(text)} characters not shown]"


class ToolRunner:
    """Runs a play's calls under the limits, on its own threads, so a call that hangs is given up
    on after ``timeout_s`` (waiting for a free thread or interpreter counts); the tool's own limits
    (the sandbox's wall clock, the interpreter client's timeout) end it. Keep ``timeout_s`` above
    those, so that a call is given up on only when it is really stuck."""

    def __init__(self, limits: ToolConfig, threads: int = 64) -> None:
        self.limits = limits
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tool")

    def run(self, tools: dict[str, Tool], calls: list[ToolCall], stats: ToolStats) -> list[dict] | None:
        """The tool messages answering ``calls``, in order; None when they would pass the
        episode's ``max_calls`` (the episode then ends, truncated)."""
        if stats.calls + len(calls) > self.limits.max_calls:
            return None
        return [{"role": "tool", "name": call.name or "?", "content": self._one(tools, call, stats)} for call in calls]

    def _one(self, tools: dict[str, Tool], call: ToolCall, stats: ToolStats) -> str:
        stats.calls += 1
        if call.error is not None:
            stats.error("malformed")
            return f"Error: {call.error}."
        if self.limits.refuse:
            stats.error("refused")
            return "Error: tool calls are turned off in this run; answer without them."
        tool = tools.get(call.name)
        if tool is None:
            stats.error("unknown_tool")
            return f"Error: there is no tool {call.name[:64]!r}; the tools are {sorted(tools)}."
        start = time.monotonic()
        future = self._pool.submit(tool, call.arguments)
        try:
            output = future.result(timeout=self.limits.timeout_s)
        except ToolError as err:
            stats.error("raised")
            output = str(err)
        except FutureTimeout:
            future.cancel()  # one still queued never runs; one running is ended by its own limits
            stats.error("timeout")
            output = f"Error: the call did not finish within {self.limits.timeout_s:g} s."
        except Exception as err:  # the tool failed: the model is told, the episode goes on
            stats.error("failed")
            output = f"Error: {type(err).__name__}: {err}"
        finally:
            stats.latencies_s.append(time.monotonic() - start)
        if not isinstance(output, str):
            output = json.dumps(output, default=str)
        return _truncated(output, self.limits.max_output_chars)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
