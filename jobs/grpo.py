"""GRPO post-training of an LLM on a text env (BlackJack, coding and math tasks) on Ray, with vLLM
policies and a TorchTitan trainer.

    python jobs/grpo.py --config jobs/configs/blackjack_tiny.yaml run.steps=60   # embedded Ray cluster
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/grpo.py --config ...
    python jobs/grpo.py --resume runs/blackjack-tiny-20261201-101500   # or --resume auto: the latest unfinished

The algorithm is ``train``: the rollouts play batches of games against the policy engines into the
replay buffer ahead of the trainer, which takes one batch a step (its group-relative advantages
computed by the buffer), adds the reference model's logprobs, trains, and syncs the new weights to
the engines. The step hooks decide what else runs and when: the checkpoint, the sync check and
evaluation (while the next batch comes in), chaos. The rest lives in ``ray_forge/run/``: the fleet
(engines and env actors that die are restarted and their games replayed), rollouts, hooks and
resume. The env (``env.name``) decides its games, its evaluation and its pictures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import ray

from envs import registry
from ray_forge.actors.buffer import BufferFiles
from ray_forge.actors.launch import Actors, start_actors
from ray_forge.cluster import pools
from ray_forge.config.schema import JobConfig
from ray_forge.core.checkpoint import CheckpointError, CheckpointManager, RandomState
from ray_forge.core.env import EnvSetup
from ray_forge.models.tiny import ModelError
from ray_forge.observe.metrics import open_metrics, timed
from ray_forge.remote import SMALL_CALL_S, RemoteCallError, call, computed
from ray_forge.run.command_line import parse_args, run_cli, stops_resumably
from ray_forge.run.directory import Run, base_model, create, open_run, run_namespace, start_point
from ray_forge.run.fleet import Fleet, FleetError
from ray_forge.run.hooks import StepHooks
from ray_forge.run.recorder import Progress, Recorder
from ray_forge.run.rollouts import Rollouts, beside  # noqa: F401 (beside: tests race their own guards with it)
from ray_forge.run.summary import summarize
from ray_forge.weights import WeightSyncError

log = logging.getLogger("grpo")

RUN_FAULTS = (RemoteCallError, FleetError, CheckpointError, WeightSyncError, TimeoutError)
"""Faults a run can meet (a dead trainer, a full disk, ...): the run stops, resumable."""


async def train(config: JobConfig, actors: Actors, fleet: Fleet, hooks: StepHooks, progress: Progress,
                first_batch: int) -> None:
    async with Rollouts(config, actors, fleet, first_batch, hooks.background()) as rollouts:
        await hooks.before_training(rollouts, progress.step)
        for step in range(progress.step + 1, config.run.steps + 1):
            started = time.monotonic()
            batch_stats, samples = await rollouts.next_batch(step)  # scored groups, with their advantages
            await hooks.closed()  # the last step's checks ran while this batch came in
            ref = await reference_logprobs(config, actors, batch_stats, samples)
            train_stats, train_s = await timed(actors.trainer.train_step(samples, ref), "train_s")
            await rollouts.played_through(step)  # buffer.fixed_lag: no batch the new weights must not reach waits
            sync = await fleet.sync_weights(actors.trainer, actors.store.spec, step)
            row = dict(**batch_stats, **train_stats, **train_s, **sync, **rollouts.rates(), **fleet.stats(),
                       **await call(actors.buffer.stats.remote(), timeout_s=SMALL_CALL_S, what="buffer.stats"))
            progress.step, progress.row = step, row
            await hooks.after_step(rollouts, step, row, started)
        await hooks.closed()


async def reference_logprobs(config: JobConfig, actors: Actors, batch_stats: dict, samples) -> ray.ObjectRef | None:
    """The reference model's logprobs of the batch (for the KL term), computed before the trainer
    fetches them; None without a reference model."""
    if actors.reference is None or not batch_stats["num_rows"]:
        return None
    ref = actors.reference.logprobs.remote(samples)
    await computed(ref, timeout_s=config.reference.call_timeout_s, what="ref.logprobs")
    return ref


async def resume(checkpoints: CheckpointManager, saved: dict | None, actors: Actors, fleet: Fleet) -> int:
    """The trainer, the buffer and the fleet's counts from the checkpoint (when resumed), then the
    engines synced to the restored weights; returns the next batch to play."""
    await checkpoints.attach(saved, trainer=actors.trainer, buffer=BufferFiles(actors.buffer), counts=fleet.counters)
    if saved is None:
        return 0
    version = saved["step"]
    await fleet.sync_weights(actors.trainer, actors.store.spec, version)
    if fleet.serving != version:  # rollouts wait for the restored version: none would ever start
        raise FleetError(f"the restored weights (version {version}) reached no engine; see the errors above")
    return saved["buffer"]["next_batch"]


async def run_job(run: Run, env: EnvSetup, model_dir: str) -> dict:
    config, run_dir = run.config, run.run_dir
    checkpoints = CheckpointManager(run_dir, config.run.checkpoint_every, config.run.keep_checkpoints, run.resume_from)
    progress, recorder = Progress(), Recorder(run_dir, config.trainer.dtype, config.run.keep_best)
    checkpoints.add(progress=progress, recorder=recorder, rng=RandomState())
    saved, wall_s = start_point(run, checkpoints)
    started_ray = pools.connect(config.cluster, namespace=run_namespace(run))
    actors = metrics = fleet = None
    try:
        metrics = open_metrics(run_dir, config, progress.step, wall_s)
        actors = start_actors(config, env, model_dir, store_name=run_dir.name)
        recorder.attach(actors.trainer, actors.model_dir)
        fleet = Fleet.of(config, actors)
        await fleet.start()
        first_batch = await resume(checkpoints, saved, actors, fleet)
        hooks = StepHooks(config, env, actors, fleet, checkpoints, recorder, metrics)
        await train(config, actors, fleet, hooks, progress, first_batch)
        final, final_row = await hooks.finish()
        await fleet.settle()
        summary = summarize(run, env, actors, fleet, recorder, final, final_row)
        metrics.images(summary["pictures"], config.run.steps)
        return summary
    finally:
        if metrics is not None:
            metrics.close()
        down = {name for name in fleet.members if fleet.down(name)} if fleet is not None else set()
        if fleet is not None:
            await fleet.close()
        if actors is not None:
            actors.shutdown(gone=down)  # a member restarting or lost would only time out
        if started_ray:
            ray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__, str(Path(__file__).parent / "configs" / "blackjack_tiny.yaml"), argv,
                      "trainer.lr=3e-5 run.steps=20")
    run = open_run(args.config, args.overrides, args.resume)
    env = registry.setup(run.config.env)
    create(run)
    with stops_resumably(run, "jobs/grpo.py", RUN_FAULTS):
        model_dir = base_model(run, env.corpus, chat=run.config.env.episode.mode == "sequence")
        summary = asyncio.run(run_job(run, env, model_dir))
    # One line: the numbers and the run's own lists; an env's per-state or per-task ones stay in eval.json.
    print(json.dumps({k: v for k, v in summary.items()
                      if not isinstance(v, (list, dict)) or k in ("pictures", "policy_versions", "engines_lost")}))
    return summary


if __name__ == "__main__":
    run_cli(main, "grpo", (ModelError,))
