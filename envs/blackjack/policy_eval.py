"""Score a text policy on BlackJack: its greedy decision table, exactly, and by Monte Carlo.

``decide`` maps a batch of prompts to completion texts; it may be a vLLM engine, a remote
actor or a plain function, so this module stays free of models and Ray. Answers are read by
the env's own ``parse_action``, and an unparseable one is valued as the env scores it: the game
ends there with the run's invalid-action penalty.
"""

from __future__ import annotations

from typing import Callable, Collection

import numpy as np

from envs.blackjack.env import DEFAULT_PENALTY, DEFAULT_WORDING, BlackjackTextEnv, State, Wording, parse_action, render_state
from envs.blackjack.exact import DecisionTable, agreement, all_states, evaluate_table, optimal_table

Decide = Callable[[list[str]], list[str]]

UNPARSEABLE = ""
"""An answer ``parse_action`` rejects, played where the table's answer was invalid."""


def decision_table(decide: Decide, wording: Wording = DEFAULT_WORDING) -> tuple[dict[State, float], frozenset[State]]:
    """The policy's action in every state (1.0 HIT, 0.0 STICK), asked with the prompts ``wording``
    writes, and the states whose answer was unparseable (their entry is 0.0, so plots that read
    0/1 still work)."""
    states = all_states()
    texts = decide([render_state(s, wording) for s in states])
    table, invalid = {}, set()
    for state, text in zip(states, texts, strict=True):
        action = parse_action(text)
        if action is None:
            invalid.add(state)
        table[state] = 1.0 if action == 1 else 0.0
    return table, frozenset(invalid)


def monte_carlo_return(table: DecisionTable, num_games: int, seed: int = 10**9, invalid: Collection[State] = (),
                       penalty: float = DEFAULT_PENALTY) -> tuple[float, float]:
    """(mean return, standard error) of ``num_games`` games dealt by the env (``envs.blackjack.cards``) and played by ``table``;
    in an ``invalid`` state the env is given an unparseable answer, so it scores it itself."""
    invalid = frozenset(invalid)
    env = BlackjackTextEnv(invalid_action_penalty=penalty)
    rewards = np.empty(num_games)
    for i in range(num_games):
        env.reset(seed + i)
        while True:
            result = env.step(_answer(table, invalid, env.state))
            if result.done:
                rewards[i] = result.reward
                break
    return float(rewards.mean()), float(rewards.std() / np.sqrt(max(1, num_games)))


def _answer(table: DecisionTable, invalid: frozenset[State], state: State) -> str:
    if state in invalid:
        return UNPARSEABLE
    return "HIT" if table.get(state, 0.0) >= 0.5 else "STICK"


def state_key(state) -> str:
    """'14/10/hard': player sum / dealer card (1 = ace) / hard or soft."""
    return f"{state.player_sum}/{state.dealer_card}/{'soft' if state.usable_ace else 'hard'}"


def evaluate(decide: Decide, mc_games: int = 0, invalid_action_penalty: float = DEFAULT_PENALTY,
             wording: Wording = DEFAULT_WORDING) -> dict:
    """exact_return, agreement, invalid answers (count, share of the 360 states, which, and the
    penalty they were valued at), the decision table (``decisions``: 1 = HIT, 0 = STICK or
    invalid), optionally mc_return.

    ``invalid_action_penalty`` must be the run's ``env.invalid_action_penalty``: it is what an
    unparseable answer earns in training, so it is what it is worth here."""
    table, invalid = decision_table(decide, wording)
    result = dict(exact_return=evaluate_table(table, invalid, invalid_action_penalty),
                  agreement=agreement(table, optimal_table(), invalid),
                  invalid_answers=len(invalid), invalid_rate=len(invalid) / len(table),
                  invalid_action_penalty=invalid_action_penalty,
                  hit_states=int(sum(table.values())),
                  decisions={state_key(s): int(h) for s, h in table.items()},
                  invalid_states=[state_key(s) for s in table if s in invalid])
    if mc_games:
        result["mc_return"], result["mc_stderr"] = monte_carlo_return(table, mc_games, invalid=invalid,
                                                                      penalty=invalid_action_penalty)
    return result
