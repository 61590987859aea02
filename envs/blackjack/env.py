"""BlackJack as a text env: one decision per turn, the prompt shows the cards that matter.

The public demo never showed the model its sum or the dealer's card, so no card-dependent
strategy could be learned. Here each prompt states the player's sum, whether an ace counts
as 11 (soft), and the dealer's face-up card.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import NamedTuple

from envs.blackjack.cards import CARDS_DEALT, deal
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


class _Hand:
    """A hand's cards as their sum and whether it holds an ace: all gymnasium's rules read."""

    __slots__ = ("first", "cards_sum", "has_ace")

    def __init__(self, *cards: int) -> None:
        self.first, self.cards_sum, self.has_ace = cards[0], 0, False
        for card in cards:
            self.add(card)

    def add(self, card: int) -> None:
        self.cards_sum += card
        self.has_ace = self.has_ace or card == 1

    @property
    def usable_ace(self) -> bool:
        """An ace that can count 11 without busting."""
        return self.has_ace and self.cards_sum + 10 <= 21

    @property
    def total(self) -> int:
        return self.cards_sum + 10 if self.usable_ace else self.cards_sum


def check_words(words: tuple[str, str]) -> None:
    """Action words ``parse_action`` reads as hit and as stick, in that order."""
    if len(words) != 2 or parse_action(words[0]) != 1 or parse_action(words[1]) != 0:
        raise ValueError(f"words = {list(words)}: they must be two, a way to say hit and then one to say stick "
                         "(hit, stick or stand, in any case)")


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


NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                "sixteen seventeen eighteen nineteen twenty twenty-one").split()
NUMBERS = ("digits", "words")


@dataclass(frozen=True)
class Wording:
    """How a prompt says a state: the action words it offers (hit's, then stick's) and whether the
    sums and cards are written as digits ("14") or as words ("fourteen")."""

    words: tuple[str, str] = ACTION_WORDS
    numbers: str = "digits"

    def __post_init__(self) -> None:
        check_words(self.words)
        if self.numbers not in NUMBERS:
            raise ValueError(f"numbers = {self.numbers!r}: it must be one of {list(NUMBERS)}")

    def number(self, n: int) -> str:
        return NUMBER_WORDS[n] if self.numbers == "words" else str(n)


DEFAULT_WORDING = Wording()


def render_state(state: State, wording: Wording = DEFAULT_WORDING) -> str:
    """The prompt of ``state`` as ``wording`` says it."""
    dealer = "A" if state.dealer_card == 1 else wording.number(state.dealer_card)
    hand = "soft" if state.usable_ace else "hard"
    hit, stick = wording.words
    return f"Your sum is {wording.number(state.player_sum)}, {hand}. Dealer shows {dealer}. {hit} or {stick}?"


def outcome_text(reward: float) -> str:
    return "You win." if reward > 0 else "You lose." if reward < 0 else "Push."


class BlackjackTextEnv(TextEnv):
    """gymnasium's Blackjack-v1 (sab=False, natural=False) behind the ``TextEnv`` protocol, dealt by
    ``envs.blackjack.cards``: the same rules and card odds, so the same exact values, without a
    NumPy call per card. ``reset_all`` deals a whole batch of games in one call."""

    def __init__(self, invalid_action_penalty: float = DEFAULT_PENALTY, wording: Wording = DEFAULT_WORDING) -> None:
        self._penalty = invalid_action_penalty
        self.wording = wording
        self.action_words = tuple(wording.words)
        self.state: State | None = None
        self._seed, self._cards, self._next = 0, [], 0
        self._player = self._dealer = _Hand(0)  # dealt by reset

    def reset(self, seed: int) -> str:
        """Same seed, same cards: GRPO groups compare decisions on identical deals."""
        return self._start(seed, deal([seed])[0].tolist())

    @classmethod
    def reset_all(cls, envs: list[BlackjackTextEnv], seeds: list[int]) -> list[str | Exception]:
        """Every game's cards in one vectorised deal."""
        decks = deal(seeds).tolist() if seeds else []
        return [env._start(seed, deck) for env, seed, deck in zip(envs, seeds, decks, strict=True)]

    def _start(self, seed: int, cards: list[int]) -> str:
        self._seed, self._cards, self._next = seed, cards, 0
        self._player, self._dealer = _Hand(self._draw(), self._draw()), _Hand(self._draw(), self._draw())
        self.state = self._observe()
        return render_state(self.state, self.wording)

    def _draw(self) -> int:
        if self._next == len(self._cards):  # a long game: the next cards of the same stream
            self._cards += deal([self._seed], self._next, CARDS_DEALT)[0].tolist()
        self._next += 1
        return self._cards[self._next - 1]

    def _observe(self) -> State:
        return State(self._player.total, self._dealer.first, self._player.usable_ace)

    def step(self, action_text: str) -> StepResult:
        action = parse_action(action_text)
        if action is None:
            self.state = None
            return StepResult(outcome_text(self._penalty), self._penalty, True, {"error": "invalid action"})
        if action == 1:
            self._player.add(self._draw())
            if self._player.total <= 21:
                self.state = self._observe()
                return StepResult(render_state(self.state, self.wording), 0.0, False, {"action": action})
            reward = -1.0
        else:
            while self._dealer.total < 17:
                self._dealer.add(self._draw())
            dealer = 0 if self._dealer.total > 21 else self._dealer.total
            reward = float((self._player.total > dealer) - (self._player.total < dealer))
        self.state = None
        return StepResult(outcome_text(reward), reward, True, {"action": action})

    @staticmethod
    def corpus(wording: Wording = DEFAULT_WORDING) -> list[str]:
        """Every text the env can show or accept, to build a tokenizer for a model made from scratch."""
        texts = [render_state(State(p, d, a), wording) for p in range(4, 22) for d in range(1, 11) for a in (False, True)]
        texts += [outcome_text(r) for r in (-1.0, 0.0, 1.0)] + list(wording.words)
        return texts
