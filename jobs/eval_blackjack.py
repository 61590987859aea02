"""Score a BlackJack policy exactly: its greedy decision in every state, valued by dynamic programming.

    python jobs/eval_blackjack.py --policy runs/<run>/final_policy [--mc-games 100000]

Prints a JSON object as its last line: exact_return, mc_return, agreement (with the optimal
table, weighted by how often the optimal policy reaches each state). References for these
rules: optimal -0.04656, best dealer-blind -0.0640, always stick -0.18637, random -0.39590.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from envs.blackjack import ACTION_WORDS, evaluate  # noqa: E402
from ray_forge.actors.policy import VLLMPolicy  # noqa: E402
from ray_forge.grpo_config import PolicyConfig  # noqa: E402
from ray_forge.models import check_model_dir  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", required=True, help="local HF folder (e.g. runs/<run>/final_policy)")
    parser.add_argument("--mc-games", type=int, default=100_000, help="Monte-Carlo cross-check games")
    parser.add_argument("--unconstrained", action="store_true",
                        help="let the model emit any token (default: only the action words' tokens)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model_dir = str(check_model_dir(args.policy))
    policy = VLLMPolicy(model_dir=model_dir, config=PolicyConfig(constrain_to_actions=not args.unconstrained),
                        action_words=ACTION_WORDS)
    try:
        result = evaluate(lambda prompts: [c.text for c in policy.generate(prompts, greedy=True)],
                          mc_games=args.mc_games)
    finally:
        policy.shutdown()
    result["policy"] = model_dir
    print(json.dumps({k: v for k, v in result.items() if k != "decisions"}))
    return result


if __name__ == "__main__":
    main()
