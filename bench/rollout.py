"""Rollout throughput: decisions per second of the whole rollout path against the engine alone.

One run, the ``make demo`` model and policy settings, the same games:
- ``rollout``: batches of 4,096 BlackJack games played the way the job plays them: the env actor
  (rollout worker) runs the game loop against a policy actor (the real vLLM engine, continuous
  batching) and puts each chunk into the replay buffer actor; this process hands out seeds only;
- ``raw``: afterwards, the very prompts of every turn the rollout asked for (read back from the
  buffer), sent to an engine with the same settings through vLLM's offline ``LLM.generate``, in
  this process, the requests each policy call makes (identical prompts merged), no Ray. The
  policy actor also shares one prompt's request among the calls that ask for it at once (a
  batch's chunks, the next batch: ``DistributionDraws.submit``), which one call at a time cannot;
- ``raw_n_samples``: the same, but each distinct prompt's ``n`` answers sampled by vLLM's own
  sampler (what the policy did before it drew one-token answers from the distribution).
Target: ``rollout`` at least 0.5x ``raw`` (issue 25; it was 0.18x before BlackJack dealt its cards
in batches and the policy answered a call with arrays). Last line: a JSON object.

    python -m bench.rollout [--batches 3] [--chunks 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import ray

from envs import registry
from envs.blackjack import ACTION_WORDS, BlackjackTextEnv
from ray_forge.actors.buffer import BufferActor
from ray_forge.actors.env_pool import EnvPoolActor
from ray_forge.actors.policy import PolicyActor
from ray_forge.actors.rollout import RolloutSettings, batch_groups
from ray_forge.config import load_config
from ray_forge.config.schema import BufferConfig, JobConfig
from ray_forge import identity
from ray_forge.models.tiny import make_tiny_qwen3
from ray_forge.run.fleet import Fleet

DEMO = Path(__file__).resolve().parent.parent / "jobs" / "configs" / "blackjack_tiny.yaml"


async def play(config: JobConfig, fleet: Fleet, buffer, batches: range, chunks: int) -> float:
    """Seconds to play ``batches``, all in flight at once (the job's rollout loop starts a batch
    while the one before is still in play)."""
    settings = RolloutSettings.of(config)
    per_batch = config.grpo.prompts_per_step
    start = time.perf_counter()
    await asyncio.gather(*(
        fleet.play(i, groups[i::chunks], settings, key=b * chunks + i, sink=(buffer, b, i, chunks))
        for b in batches
        for groups in [batch_groups(config.run.seed, b, per_batch)]
        for i in range(chunks)))
    return time.perf_counter() - start


def turn_calls(groups: list, per_batch: int, chunks: int) -> list[list[tuple[int, ...]]]:
    """The prompt token ids of every policy call the rollout made: one per turn per chunk, a chunk
    being every ``chunks``-th group of a batch of ``per_batch`` groups."""
    ordered = sorted(groups, key=lambda group: group[0].group_id)
    calls = []
    for first in range(0, len(ordered), per_batch):
        batch = ordered[first:first + per_batch]
        for i in range(chunks):
            games = [e for group in batch[i::chunks] for e in group]
            for turn in range(max(len(e.turns) for e in games)):
                calls.append([e.turns[turn].prompt_ids for e in games if len(e.turns) > turn])
    return calls


def raw(model_dir: str, config: JobConfig, calls: list[list[tuple[int, ...]]]) -> dict[str, float]:
    """Seconds for vLLM's offline generate to answer ``calls``: ``same_requests`` as the policy
    actor makes them (one per distinct prompt, its distribution for the draws), and ``n_samples``
    (one request per distinct prompt with ``n`` samples through vLLM's sampler)."""
    from vllm import SamplingParams

    from ray_forge.actors.policy import VLLMPolicy

    policy = VLLMPolicy(config.policy, model_dir=model_dir, action_words=ACTION_WORDS, seed=config.run.seed)
    try:
        def params(count: int, draws: bool) -> SamplingParams:
            return SamplingParams(n=1 if draws else count, temperature=config.policy.temperature,
                                  logprobs=len(policy.allowed_ids) if draws else 0,
                                  max_tokens=config.policy.max_tokens, allowed_token_ids=policy.allowed_ids,
                                  skip_clone=True)  # as the policy makes them

        seconds = {}
        for name, draws in (("same_requests", policy.draws), ("n_samples", False)):
            requests = []
            for prompts in calls:
                counts = Counter(prompts)
                requests.append(([{"prompt_token_ids": list(p)} for p in counts],
                                 [params(c, draws) for c in counts.values()]))
            policy.llm.generate(*requests[0], use_tqdm=False)  # warm-up; the step loop is idle meanwhile
            start = time.perf_counter()
            for prompts, sampling in requests:
                policy.llm.generate(prompts, sampling, use_tqdm=False)
            seconds[name] = time.perf_counter() - start
        return seconds
    finally:
        policy.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=2, help="concurrent play calls per batch (the job: 2)")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    config = load_config(JobConfig, DEMO)
    model_dir = str(make_tiny_qwen3(Path(tempfile.mkdtemp()) / "tiny", BlackjackTextEnv.corpus(), config.model.tiny))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        policy = PolicyActor.options(name=str(identity.policy(0)), num_cpus=0).remote(
            config.policy, model_dir=model_dir, action_words=ACTION_WORDS, seed=config.run.seed)
        env = EnvPoolActor.options(name=str(identity.env(0)), num_cpus=0).remote(config.env, registry.get("blackjack").setup({}))
        buffer = BufferActor.options(num_cpus=0).remote(BufferConfig(max_policy_lag=1_000_000, capacity_games=1 << 30))
        fleet = Fleet([policy], [env], policy_timeout_s=300, env_timeout_s=120)
        asyncio.run(fleet.start())
        asyncio.run(play(config, fleet, buffer, range(1), args.chunks))  # warm-up
        ray.get(buffer.sample.remote(config.grpo.games_per_step, 0), timeout=60)
        # Where the CPU goes: each actor process's CPU seconds during the measured batches.
        processes = {"policy": psutil.Process(fleet.pids[identity.policy(0)]), "env": psutil.Process(fleet.pids[identity.env(0)])}
        before = {name: sum(p.cpu_times()[:2]) for name, p in processes.items()}
        seconds = asyncio.run(play(config, fleet, buffer, range(1, 1 + args.batches), args.chunks))
        cpu_s = {name: round(sum(p.cpu_times()[:2]) - before[name], 2) for name, p in processes.items()}
        games = args.batches * config.grpo.games_per_step
        groups = ray.get(buffer.sample.remote(games, 0), timeout=60)
        for actor in (policy, env, buffer):
            ray.kill(actor)
    finally:
        ray.shutdown()
    calls = turn_calls(groups, config.grpo.prompts_per_step, args.chunks)
    decisions = sum(len(c) for c in calls)
    raw_s = raw(model_dir, config, calls)
    ratio = raw_s["same_requests"] / seconds
    print(json.dumps({"games": games, "decisions": decisions, "policy_calls": len(calls),
                      "distinct_prompts_per_call": round(sum(len(set(c)) for c in calls) / len(calls), 1),
                      "rollout_decisions_per_s": round(decisions / seconds),
                      "raw_decisions_per_s": round(decisions / raw_s["same_requests"]),
                      "raw_n_samples_decisions_per_s": round(decisions / raw_s["n_samples"]),
                      "rollout_vs_raw": round(ratio, 3),
                      "rollout_vs_raw_n_samples": round(raw_s["n_samples"] / seconds, 3),
                      "rollout_s": round(seconds, 3), "raw_s": round(raw_s["same_requests"], 3),
                      "actor_cpu_s": cpu_s, "target": 0.5, "met": ratio >= 0.5}))


if __name__ == "__main__":
    main()
