"""GRPO post-training of an LLM on a text env (BlackJack, or coding and math tasks), on Ray,
with vLLM policies and a TorchTitan trainer.

Local (starts an embedded Ray cluster; dashboard at http://127.0.0.1:8265):
    python jobs/grpo.py --config jobs/configs/blackjack_tiny.yaml run.steps=60 trainer.lr=3e-5
    python jobs/grpo.py --config jobs/configs/code_tiny.yaml
Against a running cluster:
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/grpo.py --config jobs/configs/blackjack_tiny.yaml run.steps=5

Flow: config -> actors -> rollout and training loops running concurrently -> weight push after
every step -> periodic greedy evaluation -> final policy saved as an HF folder -> shutdown.
The env (``env.name``; for an OpenEnv server, ``env.openenv.kind``) decides three things only, in
``jobs/env_hooks.py``: the texts a tiny model's tokenizer is trained on, the evaluation (BlackJack:
exact return of the greedy decision table; code: greedy pass rate over every task, scored by the
env pool's sandbox), and the PNGs the run ends with.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import ray
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # env_hooks, beside this file

from env_hooks import EnvHooks, env_hooks, rollout_settings  # noqa: E402
from ray_forge import cluster  # noqa: E402
from ray_forge.batch import groups_to_samples  # noqa: E402
from ray_forge.config import load_config, to_dict  # noqa: E402
from ray_forge.grpo_config import JobConfig  # noqa: E402
from ray_forge.launch import Actors, start_actors  # noqa: E402
from ray_forge.metrics import MetricsLog, read_metrics  # noqa: E402
from ray_forge.models import check_model_dir, make_tiny_qwen3  # noqa: E402
from ray_forge.remote import call, get  # noqa: E402
from ray_forge.rollout import play_groups  # noqa: E402

log = logging.getLogger("grpo")


@dataclasses.dataclass
class LoopState:
    """Shared by the two loops (one event loop, so no locks)."""

    trainer_version: int = 0
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    generated_tokens: int = 0
    played_games: int = 0
    rollout_seconds: float = 0.0


async def rollout_loop(config: JobConfig, actors: Actors, state: LoopState) -> None:
    """Consumes the policy engines and env pools; produces scored GRPO groups into the buffer.

    Waits while it is more than ``buffer.max_policy_lag`` batches ahead of the trainer, so it
    keeps playing during a train step but never far ahead of the weights. Stops when
    ``state.stop`` is set, after the batch in play.
    """
    settings = rollout_settings(config)
    num_groups = config.grpo.games_per_step // config.grpo.group_size
    num_chunks = max(len(actors.policies), len(actors.envs))
    batch = 0
    while not state.stop.is_set():
        if batch > state.trainer_version + config.buffer.max_policy_lag:
            await asyncio.sleep(0.01)
            continue
        group_ids = range(batch * num_groups, (batch + 1) * num_groups)
        groups = [(gid, config.run.seed * 1_000_003 + gid) for gid in group_ids]
        start = time.monotonic()
        results = await asyncio.gather(*(
            play_groups(actors.policies[i % len(actors.policies)], f"policy-{i % len(actors.policies)}",
                        actors.envs[i % len(actors.envs)], f"env-{i % len(actors.envs)}",
                        groups[i::num_chunks], settings, key=batch * num_chunks + i)
            for i in range(num_chunks)))
        played = [group for chunk in results for group in chunk]
        await call(actors.buffer.add.remote(played), timeout_s=60, what="buffer.add")
        state.rollout_seconds += time.monotonic() - start
        state.generated_tokens += sum(len(t.response_ids) for g in played for e in g for t in e.turns)
        state.played_games += sum(len(g) for g in played)
        batch += 1


async def next_batch(config: JobConfig, actors: Actors, state: LoopState, rollout: asyncio.Task) -> list:
    """The next ``games_per_step`` games from the buffer; fails if the rollout loop died."""
    deadline = time.monotonic() + config.policy.call_timeout_s
    while time.monotonic() < deadline:
        if rollout.done():
            rollout.result()  # re-raises the rollout's error
            raise RuntimeError("rollout loop stopped before training finished")
        groups = await call(actors.buffer.sample.remote(config.grpo.games_per_step, state.trainer_version),
                            timeout_s=60, what="buffer.sample")
        if groups is not None:
            return groups
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no training batch within {config.policy.call_timeout_s:.0f}s")


async def push_weights(config: JobConfig, actors: Actors, version: int) -> dict[str, float]:
    """The trainer puts ``version`` in the weight store; every policy pulls it in place."""
    start = time.monotonic()
    spec = actors.store.spec
    publish_s = await actors.trainer.publish_weights(spec, version)
    # A policy finishes its current generate call first, so this wait includes that.
    load_s = await asyncio.gather(*(call(p.update_weights.remote(spec, version), timeout_s=spec.timeout_s,
                                         what=f"policy-{i}.update_weights")
                                    for i, p in enumerate(actors.policies)))
    return {"weight_sync_s": time.monotonic() - start, "weight_publish_s": publish_s, "weight_load_s": max(load_s)}


async def train(config: JobConfig, hooks: EnvHooks, actors: Actors, run_dir: Path) -> dict:
    state = LoopState()
    metrics = MetricsLog(run_dir, config.run.steps, progress=config.run.progress)
    rollout = asyncio.create_task(rollout_loop(config, actors, state))
    best: dict = {}
    try:
        for step in range(1, config.run.steps + 1):
            step_start = time.monotonic()
            groups = await next_batch(config, actors, state, rollout)
            samples, batch_stats = groups_to_samples(groups, merge=config.trainer.merge_identical)
            if actors.reference is not None and samples:
                ref = await call(actors.reference.logprobs.remote(samples), timeout_s=config.reference.call_timeout_s,
                                 what="ref.logprobs")
                samples = [dataclasses.replace(s, ref_logprobs=r) for s, r in zip(samples, ref)]
            train_stats = await actors.trainer.train_step(samples) if samples else {}
            policy_lag = state.trainer_version - batch_stats["sample_policy_version"]
            state.trainer_version = step
            sync = await push_weights(config, actors, step)
            rollout_s = max(state.rollout_seconds, 1e-9)
            row = dict(**batch_stats, **train_stats, **sync, policy_lag=policy_lag,
                       tokens_per_s=state.generated_tokens / rollout_s, episodes_per_s=state.played_games / rollout_s,
                       buffer_size=await call(actors.buffer.num_games.remote(), timeout_s=60, what="buffer.num_games"))
            if config.run.eval_every and (step % config.run.eval_every == 0 or step == config.run.steps):
                _, eval_row = await hooks.evaluate(config, actors, 0)
                row.update(eval_row)
                if config.run.keep_best and eval_row["eval_return"] > best.get("eval_return", float("-inf")):
                    best = dict(eval_row, step=step)
                    await save_policy(actors, run_dir / "best_policy")
            row["step_time_s"] = time.monotonic() - step_start
            metrics.log(step, **row)
            metrics.advance(reward=row["train_reward"], eval=row.get("eval_return"), loss=row.get("loss"))
    finally:
        state.stop.set()
        metrics.close()
        try:
            await asyncio.wait_for(rollout, timeout=config.policy.call_timeout_s)
        except Exception as err:  # the rollout's own error was already raised by next_batch
            log.debug("rollout loop ended: %s", err)
    return best


async def save_policy(actors: Actors, out_dir: Path) -> None:
    """The current trainer weights as a self-contained HF folder (weights + config + tokenizer)."""
    await actors.trainer.export_hf(str(out_dir))
    model_dir = Path(get(actors.policies[0].get_model_dir.remote(), timeout_s=60, what="policy-0"))
    for item in model_dir.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy2(item, out_dir / item.name)


def prepare_model(config: JobConfig, hooks: EnvHooks, run_dir: Path) -> str:
    if config.model.path:
        return str(check_model_dir(config.model.path))
    return str(make_tiny_qwen3(run_dir / "initial_model", hooks.corpus(config), config.model.tiny))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).parent / "configs" / "blackjack_tiny.yaml"))
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-5 run.steps=20")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_config(JobConfig, args.config, args.overrides)
    hooks = env_hooks(config)
    run_dir = Path(config.run.output_dir) / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    log.info("run directory: %s", run_dir.resolve())
    model_dir = prepare_model(config, hooks, run_dir)
    started_ray = cluster.connect(config.cluster, namespace=run_dir.name)
    actors = None
    try:
        actors = start_actors(config, model_dir, store_name=run_dir.name)
        best = asyncio.run(train(config, hooks, actors, run_dir))
        asyncio.run(save_policy(actors, run_dir / "final_policy"))
        final, _ = asyncio.run(hooks.evaluate(config, actors, config.run.eval_mc_games))
        versions = get([p.get_version.remote() for p in actors.policies], timeout_s=60, what="policy versions")
        pictures = hooks.pictures(run_dir, read_metrics(run_dir / "metrics.jsonl"), final)
        summary = dict(final, run_dir=str(run_dir), steps=config.run.steps, policy_versions=versions,
                       weight_transport=actors.store.spec.transport, pictures=[str(p) for p in pictures],
                       best_eval_return=best.get("eval_return"), best_step=best.get("step"))
        (run_dir / "eval.json").write_text(json.dumps(summary, indent=2))
        log.info("final policy: %s", run_dir / "final_policy")
        print(json.dumps({k: v for k, v in summary.items() if k not in ("decisions", "tasks")}))
        return summary
    finally:
        if actors is not None:
            actors.shutdown()
        if started_ray:
            ray.shutdown()


if __name__ == "__main__":
    main()
