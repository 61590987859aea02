"""Exact expected return of a BlackJack decision table, by dynamic programming over card draws.

Rules of gymnasium Blackjack-v1 with sab=False, natural=False: an infinite deck (ten-valued
cards 4/13, others 1/13 each), the dealer draws to 17 and stands on soft 17, a natural counts
as an ordinary 21. A state is (player sum, dealer card, usable ace), which is all that matters
for the future: a hard hand's ace can never become usable again.

A policy whose answer in some states is unparseable passes those states as ``invalid``: there
the env ends the game with its invalid-action penalty, whatever the table says.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Collection, Mapping

from envs.blackjack.env import DEFAULT_PENALTY, State

CARD_PROBS = {c: (4 / 13 if c == 10 else 1 / 13) for c in range(1, 11)}
PLAYER_SUMS = range(4, 22)
DEALER_CARDS = range(1, 11)

DecisionTable = Mapping[State, float]
"""Probability of HIT in each state (0/1 for a deterministic table). States whose answer was
invalid are given apart (``invalid``); their entry here is ignored."""


def all_states() -> list[State]:
    """Every (sum, dealer, soft) combination a prompt can show: 18 x 10 x 2 = 360."""
    return [State(p, d, a) for p in PLAYER_SUMS for d in DEALER_CARDS for a in (False, True)]


def _hand_value(raw_sum: int, has_ace: bool) -> tuple[int, bool]:
    if has_ace and raw_sum + 10 <= 21:
        return raw_sum + 10, True
    return raw_sum, False


@lru_cache(maxsize=None)
def dealer_final(raw_sum: int, has_ace: bool) -> tuple[tuple[int, float], ...]:
    """Distribution of the dealer's final total (22 = bust) from a partial hand."""
    total, _ = _hand_value(raw_sum, has_ace)
    if total > 21:
        return ((22, 1.0),)
    if total >= 17:
        return ((total, 1.0),)
    dist: dict[int, float] = {}
    for card, p_card in CARD_PROBS.items():
        for final, p in dealer_final(raw_sum + card, has_ace or card == 1):
            dist[final] = dist.get(final, 0.0) + p_card * p
    return tuple(sorted(dist.items()))


@lru_cache(maxsize=None)
def stick_value(player_total: int, dealer_card: int) -> float:
    """Expected reward of sticking on ``player_total`` (the dealer's hole card not yet drawn)."""
    value = 0.0
    for final, p in dealer_final(dealer_card, dealer_card == 1):
        value += p * (1.0 if final == 22 or player_total > final else -1.0 if player_total < final else 0.0)
    return value


def hit_successors(state: State) -> list[tuple[float, State | None]]:
    """(probability, next state) for each card; None means bust."""
    raw = state.player_sum - 10 if state.usable_ace else state.player_sum
    out = []
    for card, p in CARD_PROBS.items():
        total, soft = _hand_value(raw + card, state.usable_ace or card == 1)
        out.append((p, None if total > 21 else State(total, state.dealer_card, soft)))
    return out


def initial_states() -> dict[State, float]:
    """Distribution of the first decision's state over the deal."""
    dist: dict[State, float] = {}
    for c1, p1 in CARD_PROBS.items():
        for c2, p2 in CARD_PROBS.items():
            total, soft = _hand_value(c1 + c2, c1 == 1 or c2 == 1)
            for d, pd in CARD_PROBS.items():
                s = State(total, d, soft)
                dist[s] = dist.get(s, 0.0) + p1 * p2 * pd
    return dist


def _order(state: State) -> int:
    """Raw card sum: it grows with every hit, so successors always come later."""
    return state.player_sum - 10 if state.usable_ace else state.player_sum


def state_values(p_hit: Callable[[State], float], invalid: Collection[State] = (),
                 penalty: float = DEFAULT_PENALTY) -> dict[State, float]:
    """Expected return from each state under a (possibly stochastic) policy; a game that
    reaches an ``invalid`` state ends there with ``penalty``, as the env ends it."""
    invalid = frozenset(invalid)
    values: dict[State, float] = {}
    for state in sorted(all_states(), key=_order, reverse=True):
        if state in invalid:
            values[state] = penalty
            continue
        h = p_hit(state)
        hit = sum(p * (-1.0 if nxt is None else values[nxt]) for p, nxt in hit_successors(state)) if h else 0.0
        values[state] = h * hit + (1 - h) * stick_value(state.player_sum, state.dealer_card)
    return values


def evaluate_table(table: DecisionTable, invalid: Collection[State] = (), penalty: float = DEFAULT_PENALTY) -> float:
    """Exact expected return per game of a decision table (missing states stick; ``invalid``
    states end the game with ``penalty``)."""
    values = state_values(lambda s: table.get(s, 0.0), invalid, penalty)
    return sum(p * values[s] for s, p in initial_states().items())


def optimal_table() -> dict[State, float]:
    """The return-maximising table (ties stick)."""
    table: dict[State, float] = {}
    values: dict[State, float] = {}
    for state in sorted(all_states(), key=_order, reverse=True):
        hit = sum(p * (-1.0 if nxt is None else values[nxt]) for p, nxt in hit_successors(state))
        stick = stick_value(state.player_sum, state.dealer_card)
        table[state] = 1.0 if hit > stick else 0.0
        values[state] = max(hit, stick)
    return table


def visit_probabilities(table: DecisionTable, invalid: Collection[State] = ()) -> dict[State, float]:
    """Probability that a game reaches each state under ``table`` (a game ends at an ``invalid`` one)."""
    invalid = frozenset(invalid)
    visits = dict.fromkeys(all_states(), 0.0)
    for state, p in initial_states().items():
        visits[state] += p
    for state in sorted(all_states(), key=_order):
        h = 0.0 if state in invalid else table.get(state, 0.0)
        if h and visits[state]:
            for p, nxt in hit_successors(state):
                if nxt is not None:
                    visits[nxt] += visits[state] * h * p
    return visits


def agreement(table: DecisionTable, reference: DecisionTable, invalid: Collection[State] = ()) -> float:
    """Share of decisions that match ``reference``, weighted by how often ``reference`` reaches
    each state; an ``invalid`` decision of ``table`` never matches."""
    invalid = frozenset(invalid)
    visits = visit_probabilities(reference)
    same = sum(w for s, w in visits.items()
               if s not in invalid and (table.get(s, 0.0) >= 0.5) == (reference.get(s, 0.0) >= 0.5))
    return same / sum(visits.values())
