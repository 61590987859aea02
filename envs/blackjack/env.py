"""BlackJack as a text env: one decision per turn, the prompt shows the cards that matter.

The public demo never showed the model its sum or the dealer's card, so no card-dependent
strategy could be learned. Here each prompt states the player's sum, whether an ace counts
as 11 (soft), and the dealer's face-up card.
"""

from __future__ import annotations

import string
from typing import NamedTuple

import gymnasium as gym

from ray_forge.config.schema import EnvConfig
from ray_forge.core.env import StepResult, TextEnv

ACTION_WORDS = ("HIT", "STICK")
DEFAULT_PENALTY = EnvConfig().invalid_action_penalty
"""Reward of a game ended by an unparseable answer, unless the run's ``env.invalid_action_penalty`` says otherwise."""
_ACTIONS = {"hit": 1, "stick": 0, "stand": 0}
_SURROUNDING = string.punctuation + "\u201c\u201d\u2018\u2019\u00ab\u00bb"  # ASCII and typographic quotes


class State(NamedTuple):
    player_sum: int
    dealer_card: int
    """1 is an ace."""
    usable_ace: bool


def render_state(state: State) -> str:
    dealer = "A" if state.dealer_card == 1 else str(state.dealer_card)
    hand = "soft" if state.usable_ace else "hard"
    return f"Your sum is {state.player_sum}, {hand}. Dealer shows {dealer}. HIT or STICK?"


def parse_action(text: str) -> int | None:
    """1 = hit, 0 = stick (gymnasium's encoding) when the answer's first word is HIT, STICK or
    STAND (any case, surrounding punctuation ignored); None otherwise.

    Only the first word counts: an answer that echoes the prompt ("Your sum is 14 ... HIT or
    STICK?") or hedges ("I would not hit, STICK") is invalid, not whichever word it names first;
    so is one that goes on to name the other action ("HIT or STICK?", "HIT, no STICK"), which
    would otherwise win by echoing the question's own words.
    Training rewards (``BlackjackTextEnv.step``) and evaluation both read answers here."""
    actions = [_ACTIONS.get(word.strip(_SURROUNDING).lower()) for word in text.split()]
    if not actions or actions[0] is None:
        return None
    if any(a is not None and a != actions[0] for a in actions[1:]):
        return None
    return actions[0]


def outcome_text(reward: float) -> str:
    return "You win." if reward > 0 else "You lose." if reward < 0 else "Push."


class BlackjackTextEnv(TextEnv):
    """gymnasium's Blackjack-v1 behind the ``TextEnv`` protocol."""

    action_words = ACTION_WORDS

    def __init__(self, invalid_action_penalty: float = DEFAULT_PENALTY) -> None:
        # One env per game in a batch: gymnasium's passive checker would inspect every new one's first calls.
        self._env = gym.make("Blackjack-v1", sab=False, natural=False, disable_env_checker=True)
        self._penalty = invalid_action_penalty
        self.state: State | None = None

    def reset(self, seed: int) -> str:
        """Same seed, same cards: GRPO groups compare decisions on identical deals."""
        obs, _ = self._env.reset(seed=seed)
        self.state = State(int(obs[0]), int(obs[1]), bool(obs[2]))
        return render_state(self.state)

    def step(self, action_text: str) -> StepResult:
        action = parse_action(action_text)
        if action is None:
            self.state = None
            return StepResult(outcome_text(self._penalty), self._penalty, True, {"error": "invalid action"})
        obs, reward, terminated, truncated, _ = self._env.step(action)
        done = bool(terminated or truncated)
        self.state = None if done else State(int(obs[0]), int(obs[1]), bool(obs[2]))
        text = outcome_text(reward) if done else render_state(self.state)
        return StepResult(text, float(reward), done, {"action": action})

    @staticmethod
    def corpus() -> list[str]:
        """Every text the env can show or accept, to build a tokenizer for a model made from scratch."""
        texts = [render_state(State(p, d, a)) for p in range(4, 22) for d in range(1, 11) for a in (False, True)]
        texts += [outcome_text(r) for r in (-1.0, 0.0, 1.0)] + list(ACTION_WORDS)
        return texts
