"""BlackJack (the rules of gymnasium Blackjack-v1, sab=False, natural=False; its own dealing) as a multi-turn text env."""

from envs.blackjack.env import ACTION_WORDS, DEFAULT_PENALTY, BlackjackTextEnv, State, Wording, parse_action, render_state
from envs.blackjack.exact import DecisionTable, evaluate_table, optimal_table
from envs.blackjack.policy_eval import decision_table, evaluate, monte_carlo_return
from envs.blackjack.spec import SPEC, BlackjackOptions

__all__ = [
    "SPEC",
    "BlackjackOptions",
    "ACTION_WORDS",
    "DEFAULT_PENALTY",
    "BlackjackTextEnv",
    "DecisionTable",
    "State",
    "Wording",
    "decision_table",
    "evaluate",
    "evaluate_table",
    "monte_carlo_return",
    "optimal_table",
    "parse_action",
    "render_state",
]
