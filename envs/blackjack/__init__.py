"""BlackJack (gymnasium Blackjack-v1, sab=False, natural=False) as a multi-turn text env."""

from envs.blackjack.env import ACTION_WORDS, BlackjackTextEnv, State, parse_action, render_state
from envs.blackjack.exact import DecisionTable, evaluate_table, optimal_table

__all__ = [
    "ACTION_WORDS",
    "BlackjackTextEnv",
    "DecisionTable",
    "State",
    "evaluate_table",
    "optimal_table",
    "parse_action",
    "render_state",
]
