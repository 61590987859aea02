"""Score a BlackJack policy exactly: its greedy decision in every state, valued by dynamic programming.

    python jobs/eval_blackjack.py --policy runs/<run>/final_policy [--mc-games 100000]

Prints a JSON object as its last line: exact_return, mc_return, agreement (with the optimal
table, weighted by how often the optimal policy reaches each state), invalid_answers and
invalid_rate. Answers are read as the env reads them (their first word), and an unparseable
one ends the game with the invalid-action penalty: the run's ``env.invalid_action_penalty``
when the policy folder sits in a run directory, else ``--invalid-action-penalty``. References
for these rules: optimal -0.04656, best dealer-blind -0.0640, always stick -0.18637, random -0.39590.

By default the engine may only answer HIT or STICK: with a tokenizer that has each as one
token, by restricting the one generated token; otherwise (Qwen's "STICK" is several tokens) by
vLLM's structured outputs choosing among the whole words.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from envs.blackjack import ACTION_WORDS, DEFAULT_PENALTY, evaluate
from ray_forge.actors.policy import VLLMPolicy
from ray_forge.config import load_config
from ray_forge.config.schema import JobConfig
from ray_forge.models.tiny import check_model_dir
from ray_forge.run.directory import CONFIG_FILE, load_run_config

log = logging.getLogger("eval_blackjack")

DEMO_CONFIG = Path(__file__).parent / "configs" / "blackjack_tiny.yaml"
LISTED_KEYS = ("decisions", "invalid_states")
"""Per-state results: in the returned dict, not on the printed line."""


def run_penalty(model_dir: Path) -> float | None:
    """``env.invalid_action_penalty`` of the run whose ``final_policy``/``best_policy`` this is; None if none."""
    config_file = model_dir.parent / CONFIG_FILE
    if not config_file.is_file():
        return None
    return load_run_config(model_dir.parent).env.invalid_action_penalty


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", required=True, help="local HF folder (e.g. runs/<run>/final_policy)")
    parser.add_argument("--mc-games", type=int, default=100_000, help="Monte-Carlo cross-check games")
    parser.add_argument("--unconstrained", action="store_true",
                        help="let the model emit any text (default: only the action words)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer with --unconstrained")
    parser.add_argument("--invalid-action-penalty", type=float, default=None,
                        help=f"reward of an unparseable answer (default: the run's, else {DEFAULT_PENALTY})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model_dir = check_model_dir(args.policy)
    penalty = args.invalid_action_penalty
    if penalty is None:
        penalty = run_penalty(model_dir)
        penalty = DEFAULT_PENALTY if penalty is None else penalty
    log.info("an unparseable answer is worth %g", penalty)
    # The demo's engine settings: constrained answers are whole action words, one token each.
    config = load_config(JobConfig, DEMO_CONFIG).policy
    if args.unconstrained:
        config = dataclasses.replace(config, constrain_to_actions=False, max_tokens=args.max_tokens)
    policy = VLLMPolicy(config, model_dir=str(model_dir), action_words=ACTION_WORDS)
    try:
        result = evaluate(lambda prompts: [c.text for c in policy.generate(prompts, greedy=True)],
                          mc_games=args.mc_games, invalid_action_penalty=penalty)
    finally:
        policy.shutdown()
    result["policy"] = str(model_dir)
    print(json.dumps({k: v for k, v in result.items() if k not in LISTED_KEYS}))
    return result


if __name__ == "__main__":
    main()
