"""Env throughput: BlackJack games per second through an env actor against gymnasium's own loop.

The same games (seeds) and the same rule (hit below 17) three ways, in one run:
- ``raw``: gymnasium's Blackjack-v1 stepped in this process, no text, no Ray;
- ``env_actor``: the env actor driven from this process, one batched ``reset`` and one batched
  ``step`` per turn for all games (prompts rendered and answers parsed in the actor, observations
  and actions over Ray), the rule applied here to each prompt;
- ``in_worker``: the rollout worker's whole loop (``EnvPool.play``): the same, plus a policy
  actor asked once per turn (the rule again, not an engine) and the episodes built.
Target: ``env_actor`` at least 0.5x ``raw``. Last line: a JSON object.

    python -m bench.env [--games 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import gymnasium as gym
import ray

from envs import registry
from ray_forge.actors.env_pool import EnvPoolActor
from ray_forge.actors.rollout import RolloutSettings
from ray_forge.config.schema import EnvConfig
from ray_forge.core.episode import Turn

GROUP = 8


def hits(player_sum: int) -> bool:
    return player_sum < 17


class RulePolicy:
    """A typed stand-in for the engine: answers by the rule from the prompt's sum."""

    def generate(self, prompts: list[str], greedy: bool = False, seed: int | None = None,
                 priority: int = 0) -> list[Turn]:
        return [Turn((0,), (1,), (-0.7,), 0, "HIT" if hits(int(p.split()[3].rstrip(","))) else "STICK")
                for p in prompts]


def raw(seeds: list[int]) -> int:
    env = gym.make("Blackjack-v1", sab=False, natural=False)
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        done = False
        while not done:
            obs, _, terminated, truncated, _ = env.step(1 if hits(int(obs[0])) else 0)
            done = terminated or truncated
    return len(seeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    groups = [(g, 1000 + g) for g in range(args.games // GROUP)]
    seeds = [seed for _, seed in groups for _ in range(GROUP)]
    settings = RolloutSettings(group_size=GROUP, max_turns=10, invalid_action_penalty=-1.0, policy_timeout_s=120,
                               env_timeout_s=120)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        env = EnvPoolActor.options(num_cpus=0).remote(EnvConfig(), registry.get("blackjack").setup({}))
        policy = ray.remote(RulePolicy).options(num_cpus=0).remote()

        def in_worker() -> int:
            played = ray.get(env.play.remote(policy, "rule", groups, settings, 0), timeout=600)
            return sum(len(g) for g in played)

        def env_actor() -> int:
            results = ray.get(env.reset.remote(1, seeds), timeout=600)
            active = [i for i, r in enumerate(results) if not r.done]
            while active:
                actions = ["HIT" if hits(int(results[i].observation.split()[3].rstrip(","))) else "STICK"
                           for i in active]
                stepped = ray.get(env.step.remote(1, active, actions), timeout=600)
                for i, result in zip(active, stepped):
                    results[i] = result
                active = [i for i in active if not results[i].done]
            ray.get(env.release.remote(1), timeout=600)
            return len(results)

        paths = {"raw": lambda: raw(seeds), "env_actor": env_actor, "in_worker": in_worker}
        for fn in paths.values():  # warm-up (actor start, imports)
            fn()
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, fn in paths.items():
                start = time.perf_counter()
                assert fn() == len(seeds)
                times[name].append(time.perf_counter() - start)
        ray.kill(env), ray.kill(policy)
    finally:
        ray.shutdown()
    rate = {name: len(seeds) / statistics.median(t) for name, t in times.items()}
    ratio = rate["env_actor"] / rate["raw"]
    print(json.dumps({"games": len(seeds), **{f"{k}_games_per_s": round(v) for k, v in rate.items()},
                      "env_actor_vs_raw": round(ratio, 3),
                          "in_worker_vs_raw": round(rate["in_worker"] / rate["raw"], 3),
                      "target_env_actor_vs_raw": 0.5, "met": ratio >= 0.5}))


if __name__ == "__main__":
    main()
