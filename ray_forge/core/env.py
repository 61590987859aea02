"""The env protocol: small, typed, Gymnasium-shaped, for multi-turn text environments.

Envs know nothing of Ray or models. An env pool actor drives many of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)
    """``info["error"]`` says why a game ended early (e.g. an unparseable action)."""


class TextEnv(Protocol):
    """One episode at a time: ``reset`` then ``step`` until ``done``."""

    action_words: tuple[str, ...] | None
    """The valid actions when the action space is a small set of words (enables constrained
    sampling); None for free-form actions such as code."""

    def reset(self, seed: int) -> str:
        """Start an episode; the same seed deals the same episode. Returns the first prompt."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Apply the model's completion. Unparseable text ends the episode with a penalty."""
        ...
