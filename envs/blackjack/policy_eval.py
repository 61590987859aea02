"""Score a text policy on BlackJack: its greedy decision table, exactly, and by Monte Carlo.

``decide`` maps a batch of prompts to completion texts; it may be a vLLM engine, a remote
actor or a plain function, so this module stays free of models and Ray.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from envs.blackjack.env import BlackjackTextEnv, parse_action, render_state
from envs.blackjack.exact import DecisionTable, agreement, all_states, evaluate_table, optimal_table

Decide = Callable[[list[str]], list[str]]


def decision_table(decide: Decide) -> tuple[dict, int]:
    """The policy's action in every state; unparseable answers count as STICK and are counted."""
    states = all_states()
    texts = decide([render_state(s) for s in states])
    table, num_invalid = {}, 0
    for state, text in zip(states, texts, strict=True):
        action = parse_action(text)
        num_invalid += action is None
        table[state] = 1.0 if action == 1 else 0.0
    return table, num_invalid


def monte_carlo_return(table: DecisionTable, num_games: int, seed: int = 10**9) -> tuple[float, float]:
    """(mean return, standard error) of ``num_games`` real gymnasium games played by ``table``."""
    env = BlackjackTextEnv()
    rewards = np.empty(num_games)
    for i in range(num_games):
        env.reset(seed + i)
        while True:
            result = env.step("HIT" if table.get(env.state, 0.0) >= 0.5 else "STICK")
            if result.done:
                rewards[i] = result.reward
                break
    return float(rewards.mean()), float(rewards.std() / np.sqrt(max(1, num_games)))


def state_key(state) -> str:
    """'14/10/hard': player sum / dealer card (1 = ace) / hard or soft."""
    return f"{state.player_sum}/{state.dealer_card}/{'soft' if state.usable_ace else 'hard'}"


def evaluate(decide: Decide, mc_games: int = 0) -> dict:
    """exact_return, agreement, invalid answers, the decision table (1 = HIT), optionally mc_return."""
    table, num_invalid = decision_table(decide)
    result = dict(exact_return=evaluate_table(table), agreement=agreement(table, optimal_table()),
                  invalid_answers=num_invalid, hit_states=int(sum(table.values())),
                  decisions={state_key(s): int(h) for s, h in table.items()})
    if mc_games:
        result["mc_return"], result["mc_stderr"] = monte_carlo_return(table, mc_games)
    return result
