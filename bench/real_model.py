"""The pipeline's overhead on a real architecture: SmolLM2-135M-Instruct on BlackJack decisions.

Two ratios, each against a plain baseline measured in the same run, on the same rows:
- **generation**: the policy engine's ``generate`` as a run calls it (``make demo-real``'s
  config: chat prompts, one token constrained to hit/stick, each distinct prompt's distribution
  computed once and its answers drawn from it) against vLLM alone (the same ``LLM``'s offline
  API, constrained the same way) on the same decisions, one request each; and against vLLM
  alone on the distinct prompts only (the same forwards the engine runs, without its wrapping).
- **training**: a TorchTitan rank's ``train_step`` (FSDP2 on gloo, one rank) against plain torch:
  transformers' model of the same folder, the same threads, the same math (merged rows, each
  distinct input once, the head only at the answer's position: ``sampled_logprobs``), a
  forward, a backward and an AdamW step. The rows are the decisions' prompts as the engine is
  given them, each with one of the two answers. Training runs first: vLLM binds the process's
  threads when it starts.

    python -m bench.real_model [--decisions 2048] [--repeats 3] [overrides ...]

Last line: a JSON object. Timings are this machine's, on the day: run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "jobs" / "configs" / "blackjack_smollm2.yaml"


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def generation(config, model_dir: str, prompts: list[str], repeats: int) -> dict:
    """Decisions per second of the engine and of vLLM alone."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from ray_forge.actors.policy import VLLMPolicy

    words = tuple(config.env.options["blackjack"]["words"])
    policy = VLLMPolicy(config.policy, model_dir=model_dir, action_words=words)
    try:
        ids = [{"prompt_token_ids": list(policy._encode(p))} for p in prompts]
        distinct = list({tuple(i["prompt_token_ids"]): i for i in ids}.values())
        one = SamplingParams(n=1, max_tokens=1, logprobs=0, allowed_token_ids=policy.allowed_ids,
                             temperature=config.policy.temperature)
        def engine_step() -> None:
            # A run asks for each distribution once per weight version; the engine keeps them for
            # the version's later calls. Each repeat stands for a new version.
            policy.draws._known.clear()
            policy.generate(prompts)

        engine = median_s(engine_step, repeats)
        alone = median_s(lambda: policy.llm.generate(ids, one, use_tqdm=False), repeats)
        forwards = median_s(lambda: policy.llm.generate(distinct, one, use_tqdm=False), repeats)
    finally:
        policy.shutdown()
    n = len(prompts)
    return dict(decisions=n, distinct_prompts=len(distinct), engine_decisions_per_s=n / engine,
                vllm_per_decision_decisions_per_s=n / alone, vllm_distinct_only_s=forwards, engine_s=engine,
                engine_vs_vllm_per_decision=alone / engine, engine_vs_vllm_distinct_only=forwards / engine)


def training(config, model_dir: str, samples: list, repeats: int, allowed: list[int] | None) -> dict:
    """Tokens per second of a TorchTitan rank's step and of plain torch, on the same merged rows,
    both restricted to the ``allowed`` answer tokens (and centred, as the config says) as a run is."""
    import torch
    from transformers import AutoModelForCausalLM

    from ray_forge.actors.trainer import TitanTrainer, free_address
    from ray_forge.core.algorithm import grpo_loss
    from ray_forge.core.batch import collate, sampled_logprobs
    from ray_forge.core.episode import merge_identical

    rows = merge_identical(samples)
    tokens = sum(len(s.token_ids) for s in rows)
    rank = TitanTrainer(config.trainer, grpo=config.grpo, model_dir=model_dir, total_steps=repeats + 2, rank=0,
                        allowed_token_ids=allowed, temperature=config.policy.temperature)
    rank.setup(*free_address())
    titan = median_s(lambda: rank.train_step(rows), repeats)
    threads = torch.get_num_threads()  # the rank set it from trainer.resources
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.trainer.lr)
    batch = collate(rows)
    allowed_ids = torch.tensor(allowed) if allowed else None
    centre = config.grpo.center_actions

    def forward_at(inputs_DT, rows_DT):
        return model.lm_head(model.model(inputs_DT).last_hidden_state[rows_DT])

    def plain_step() -> None:
        logprobs, entropy, *actions = sampled_logprobs(forward_at, batch.inputs_BT, batch.targets_BT, batch.mask_BT,
                                                       allowed_ids, config.policy.temperature, with_actions=centre)
        grpo_loss(logprobs, batch.behaviour_logprobs_BT, batch.advantages_B, batch.mask_BT,
                  clip_eps=config.grpo.clip_eps, weights_B=batch.weights_B, entropy_BT=entropy,
                  entropy_coef=config.grpo.entropy_coef, actions=actions[0] if actions else None).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    plain = median_s(plain_step, repeats)
    return dict(rows=len(rows), samples=len(samples), tokens=tokens, threads=threads,
                titan_tokens_per_s=tokens / titan, plain_tokens_per_s=tokens / plain, titan_s=titan, plain_s=plain,
                titan_vs_plain=plain / titan)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decisions", type=int, default=2048, help="first decisions of this many games")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, as jobs/grpo.py takes them")
    args = parser.parse_args(argv)
    from envs.blackjack import SPEC
    from ray_forge.actors.policy import action_token_ids
    from ray_forge.config import load_config
    from ray_forge.config.schema import JobConfig
    from ray_forge.core.chat import text_prompt_ids
    from ray_forge.core.episode import Sample
    from ray_forge.models.gguf import convert, smollm2_gguf
    from transformers import AutoTokenizer

    config = load_config(JobConfig, CONFIG, args.overrides)
    model_dir = str(convert(smollm2_gguf(), ROOT / config.model.path))
    env = SPEC.setup(config.env.options["blackjack"]).make_env(config.env.invalid_action_penalty)()
    prompts = [env.reset(seed) for seed in range(args.decisions)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encode = text_prompt_ids(tokenizer, config.policy.chat_prompts, config.policy.system_prompt)  # as the engine does
    answers = [tokenizer.encode(word, add_special_tokens=False) for word in env.action_words]
    samples = []
    for i, prompt in enumerate(prompts):
        ids = encode(prompt)
        samples.append(Sample.completion(ids, tuple(answers[i % 2]), behaviour_logprobs=(-0.7,) * len(answers[i % 2]),
                                         advantage=1.0 if i % 3 else -1.0, policy_version=0))
    allowed = action_token_ids(tokenizer, env.action_words) if config.policy.constrain_to_actions else None
    trained = training(config, model_dir, samples, args.repeats, allowed)
    result = dict(bench="real_model", model="SmolLM2-135M-Instruct", training=trained,
                  generation=generation(config, model_dir, prompts, args.repeats))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
