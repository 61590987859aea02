"""GRPO post-training of an LLM on a text env (BlackJack, coding and math tasks) on Ray, with vLLM
policies and a TorchTitan trainer.

    python jobs/grpo.py --config jobs/configs/blackjack_tiny.yaml run.steps=60   # embedded Ray cluster
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/grpo.py --config ...
    python jobs/grpo.py --resume runs/blackjack-tiny-20261201-101500   # or --resume auto: the latest unfinished

The algorithm is the two loops below: ``rollout_loop`` plays batches of games against the policy
engines into the replay buffer while ``train`` takes batches from it, trains a step, syncs the
weights to the engines and now and then checkpoints; the step's sync check and evaluation
(``close_step``) run while the next batch comes in. The rest
lives in ``ray_forge/run/``: the fleet (engines and env actors that die are restarted and their
games replayed), checkpoints and resume. The env (``env.name``) decides its games, its evaluation
and its pictures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Awaitable, TypeVar

import ray

from envs import registry
from ray_forge.actors.launch import Actors, start_actors
from ray_forge.actors.rollout import RolloutSettings, batch_groups
from ray_forge.cluster import pools
from ray_forge.config import to_dict
from ray_forge.config.schema import JobConfig
from ray_forge.core.checkpoint import CheckpointError
from ray_forge.core.env import EnvSetup
from ray_forge.models.tiny import ModelError
from ray_forge.observe.metrics import MetricsLog, timed
from ray_forge.observe.trackers import open_trackers
from ray_forge.remote import RemoteCallError, call, computed
from ray_forge.run.chaos import NodeChaos, chaos_monkey
from ray_forge.run.checkpoints import Checkpoints, Progress, Restored
from ray_forge.run.command_line import parse_args, run_cli, stops_resumably
from ray_forge.run.directory import Run, base_model, create, open_run
from ray_forge.run.fleet import CARRIED, Fleet, FleetError
from ray_forge.run.summary import summarize
from ray_forge.weights import WeightSyncError

log = logging.getLogger("grpo")
T = TypeVar("T")

RUN_FAULTS = (RemoteCallError, FleetError, CheckpointError, WeightSyncError, TimeoutError)
"""Faults a run can meet (a dead trainer, a full disk, ...): the run stops, resumable."""


@dataclasses.dataclass
class LoopState:
    """Shared by the loops (one event loop, so no locks)."""

    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    generated_tokens: int = 0
    played_games: int = 0
    rollout_seconds: float = 0.0
    """Time some batch was in play: the rates divide by it."""
    batch_seconds: list[float] = dataclasses.field(default_factory=list)
    """How long each batch finished since the last metrics row was in play."""
    played: set[int] = dataclasses.field(default_factory=set)
    """Batches wholly in the buffer (``buffer.fixed_lag`` waits for them)."""
    progress: asyncio.Condition = dataclasses.field(default_factory=asyncio.Condition)

    def rates(self) -> dict[str, float | None]:
        """The rollout's rates for a metrics row; starts the next row's batch times."""
        batch_s, self.batch_seconds = self.batch_seconds, []
        rollout_s = max(self.rollout_seconds, 1e-9)
        return dict(rollout_batch_s=sum(batch_s) / len(batch_s) if batch_s else None,
                    tokens_per_s=self.generated_tokens / rollout_s, episodes_per_s=self.played_games / rollout_s)


async def rollout_loop(config: JobConfig, actors: Actors, fleet: Fleet, state: LoopState, batch: int) -> None:
    """Hands out batches of seeds, from ``batch`` on, to the env actors, which play them against the
    engines and put the scored groups into the buffer: only counts come back here. A batch starts
    as soon as it is at most ``buffer.max_policy_lag`` batches ahead of the weights the engines
    hold, even while the one before is in play (the engines batch the turns of both). Stops when
    ``state.stop`` is set, after the batches in play."""
    settings = RolloutSettings.of(config)
    num_groups = config.grpo.prompts_per_step
    num_chunks = max(len(actors.policies), len(actors.envs))
    playing: set[asyncio.Task] = set()
    clock = time.monotonic()

    async def play(batch: int) -> None:
        start = time.monotonic()
        groups = batch_groups(config.run.seed, batch, num_groups)
        counts = await asyncio.gather(*(
            fleet.play(i, groups[i::num_chunks], settings, key=batch * num_chunks + i,
                       sink=(actors.buffer, batch, i, num_chunks))
            for i in range(num_chunks)))
        state.generated_tokens += sum(c["tokens"] for c in counts)
        state.played_games += sum(c["games"] for c in counts)
        state.batch_seconds.append(time.monotonic() - start)
        async with state.progress:
            state.played.add(batch)
            state.progress.notify_all()

    try:
        while not state.stop.is_set() or playing:
            now = time.monotonic()
            if playing:
                state.rollout_seconds += now - clock
            clock = now
            if not state.stop.is_set() and batch <= fleet.serving + config.buffer.max_policy_lag:
                playing.add(asyncio.create_task(play(batch)))
                batch += 1
                continue
            if not playing:
                await asyncio.sleep(0.01)
                continue
            done, playing = await asyncio.wait(playing, timeout=0.01, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a batch that failed on every pair stops the run
    finally:
        for task in playing:
            task.cancel()
        await asyncio.gather(*playing, return_exceptions=True)  # one that ended on an error meanwhile is not news


async def next_batch(config: JobConfig, actors: Actors, version: int,
                     guards: tuple[asyncio.Task, ...]) -> tuple[dict, ray.ObjectRef]:
    """A step's games, made into samples by the buffer: (their statistics, a reference to the samples,
    which the trainer fetches itself). Fails if a guard (the rollout loop, the trainer's watch) fails first."""
    limit_s = 2 * RolloutSettings.of(config).play_limit_s  # a backstop: every rollout call has its own timeout
    batch = await beside(guards, call(
        actors.buffer.wait_batch.remote(config.grpo.games_per_step, version, config.trainer.merge_identical, limit_s,
                                        config.grpo.scale_rewards, config.grpo.baseline),
        timeout_s=limit_s + 60, what="buffer.wait_batch"), "training finished")
    if batch is None:
        raise TimeoutError(f"no training batch within {limit_s:.0f}s")
    return batch


async def played(state: LoopState, batches: range, guards: tuple[asyncio.Task, ...]) -> None:
    """Until every batch of ``batches`` is in the buffer; fails if a guard fails first."""
    async def all_played() -> None:
        async with state.progress:
            await state.progress.wait_for(lambda: state.played.issuperset(batches))

    await beside(guards, all_played(), "its batches were played")


async def beside(guards: tuple[asyncio.Task, ...], work: Awaitable[T], what: str) -> T:
    """``work``'s result, unless a guard (a task that runs as long as the run: the rollout loop,
    the trainer's watch) ends first: then its error."""
    wait = asyncio.ensure_future(work)
    await asyncio.wait({wait, *guards}, return_when=asyncio.FIRST_COMPLETED)
    if not wait.done():
        wait.cancel()  # a call whose answer came meanwhile ends on it, not on the cancel: its error is not news
        wait.add_done_callback(lambda task: task.cancelled() or task.exception())
        for guard in guards:
            if guard.done():
                guard.result()  # re-raises its error
        raise RuntimeError(f"the rollout loop or the trainer's watch stopped before {what}")
    return wait.result()


async def train(config: JobConfig, env: EnvSetup, actors: Actors, fleet: Fleet, checkpoints: Checkpoints,
                progress: Progress, first_batch: int, metrics: MetricsLog) -> None:
    lose_nodes = NodeChaos(config.chaos.kill_nodes, actors.by_name()) if config.chaos.kill_nodes else None
    state = LoopState()
    settings = RolloutSettings.of(config)
    rollout = asyncio.create_task(rollout_loop(config, actors, fleet, state, first_batch))
    guards = (rollout, asyncio.create_task(actors.trainer.watch()))  # a lost trainer node stops the run at once
    chaos = [asyncio.create_task(chaos_monkey(config.chaos, fleet, state.stop))] if config.chaos.every_s else []
    if lose_nodes is not None:
        chaos.append(asyncio.create_task(lose_nodes.run(metrics, state.stop)))
    closing: asyncio.Task | None = None
    try:
        if config.run.eval_before_train and progress.step == 0:
            (result, row), eval_s = await beside(guards, timed(fleet.evaluate(settings), "eval_s"),
                                                 "the evaluation before training")
            await checkpoints.keep_evaluation(actors, progress, 0, result, row)
            metrics.log(0, **row, **eval_s)
        for step in range(progress.step + 1, config.run.steps + 1):
            step_start = time.monotonic()
            batch_stats, samples = await next_batch(config, actors, step - 1, guards)
            if closing is not None:  # the last step's checks ran while this batch came in
                await closing
            ref = None
            if actors.reference is not None and batch_stats["num_rows"]:
                ref = actors.reference.logprobs.remote(samples)
                await computed(ref, timeout_s=config.reference.call_timeout_s, what="ref.logprobs")  # for the trainer
            train_stats, train_s = await timed(actors.trainer.train_step(samples, ref), "train_s")
            if config.buffer.fixed_lag:  # the batches the new weights must not reach are played first
                await played(state, range(first_batch, step + config.buffer.max_policy_lag), guards)
            sync = await fleet.sync_weights(actors.trainer, actors.store.spec, step)
            row = dict(**batch_stats, **train_stats, **train_s, **sync, **state.rates(), **fleet.stats(),
                       **await call(actors.buffer.stats.remote(), timeout_s=60, what="buffer.stats"))
            progress.step, progress.row = step, row
            if step == config.run.steps or (config.run.checkpoint_every and step % config.run.checkpoint_every == 0):
                # Now, before the next batch leaves the buffer (its row is written back on resume if lost).
                progress.counts = {k: row[k] for k in CARRIED}
                row["checkpoint_s"] = await checkpoints.save(actors, progress)
            # Raced against the guards too: an evaluation waiting for a lost engine must not keep a
            # lost trainer unnoticed (the loop awaits this close before it next calls the trainer).
            closing = asyncio.create_task(beside(guards, close_step(config, env, actors, fleet, checkpoints, progress,
                                                                    metrics, step, row, step_start), f"step {step} closed"))
            if config.run.keep_best:  # a best policy is saved from the trainer, before it trains on
                await closing
        if closing is not None:
            await closing
    except BaseException:
        rollout.cancel()  # the run stops: its games in play are not waited for (a resumed run plays them)
        raise
    finally:
        state.stop.set()
        guards[1].cancel()
        await asyncio.gather(guards[1], return_exceptions=True)  # its error, if any, was raised already
        if closing is not None:  # its error, if it ended on one, is the run's own seen again (a dead trainer)
            closing.cancel()
            await asyncio.gather(closing, return_exceptions=True)
        try:
            await asyncio.wait_for(asyncio.gather(rollout, *chaos, return_exceptions=True),
                                   timeout=config.policy.call_timeout_s)
        except Exception as err:  # the rollout's own error was already raised by next_batch
            log.debug("rollout loop ended: %s", err)


async def close_step(config: JobConfig, env: EnvSetup, actors: Actors, fleet: Fleet, checkpoints: Checkpoints,
                     progress: Progress, metrics: MetricsLog, step: int, row: dict, step_start: float) -> None:
    """A step's sync check and evaluation, then its metrics row. It runs while the next batch comes
    in, off the training loop's path; the next step trains and syncs only after it, so the check
    reads the trainer and the first engine up, and the evaluation that engine, as this step left them."""
    check_due = bool(config.run.sync_check_every) and step % config.run.sync_check_every == 0
    eval_due = bool(config.run.eval_every) and (step % config.run.eval_every == 0 or step == config.run.steps)
    (checked, check_s), (evaluated, eval_s) = await asyncio.gather(
        timed(fleet.check_sync(actors.trainer, env.probe_prompts(), seed=config.run.seed + step,
                               count=config.run.sync_check_prompts,
                               tolerance=config.run.sync_check_tolerance) if check_due else None, "sync_check_s"),
        timed(fleet.evaluate(RolloutSettings.of(config)) if eval_due else None, "eval_s"))
    row.update(**(checked or {}), **check_s)
    if evaluated is not None:
        result, eval_row = evaluated
        row.update(eval_row, **eval_s)
        await checkpoints.keep_evaluation(actors, progress, step, result, eval_row)
    await fleet.roll_call()  # a member restarted while idle counts too
    row.update(fleet.stats(), step_time_s=time.monotonic() - step_start)  # the restarts and kills until now
    metrics.log(step, **row)
    metrics.advance(reward=row["train_reward"], eval=row.get("eval_return"), loss=row.get("loss"))


async def end_on_average(config: JobConfig, env: EnvSetup, actors: Actors, fleet: Fleet) -> dict:
    """The run ends on the moving average of its weights (``trainer.ema_decay``): the trainer ranks
    take it, the engines load it as one more version, and the first engine up is checked against it."""
    await actors.trainer.use_average()
    version = config.run.steps + 1
    await fleet.sync_weights(actors.trainer, actors.store.spec, version)
    if not config.run.sync_check_every:
        return {}
    return await fleet.check_sync(actors.trainer, env.probe_prompts(), seed=config.run.seed + version,
                                  count=config.run.sync_check_prompts,
                                  tolerance=config.run.sync_check_tolerance)


async def run_job(run: Run, env: EnvSetup, model_dir: str, start: Restored) -> dict:
    config, run_dir = run.config, run.run_dir
    checkpoints, progress = Checkpoints(run), start.progress
    # A resumed run gets a namespace of its own: the killed attempt's named actors may not be gone yet.
    namespace = run_dir.name + (f"-resumed-{time.strftime('%H%M%S')}" if run.resumed else "")
    started_ray = pools.connect(config.cluster, namespace=namespace)
    actors = metrics = fleet = None
    try:
        metrics = MetricsLog(run_dir, config.run.steps, progress=config.run.progress, done_steps=progress.step,
                             wall_offset_s=start.wall_s,
                             trackers=open_trackers(config.run.loggers, run_dir, to_dict(config), progress.step))
        actors = start_actors(config, env, model_dir, store_name=run_dir.name)
        fleet = Fleet(actors.policies, actors.envs, policy_timeout_s=config.policy.call_timeout_s,
                      env_timeout_s=config.env.call_timeout_s, capacity_timeout_s=config.cluster.placement_timeout_s,
                      needs=lambda role: actors.pools.need(role.value, config.cluster.pool_labels),
                      lag=0 if config.buffer.fixed_lag else config.buffer.max_policy_lag, steps=config.run.steps)
        await fleet.start()
        first_batch = await checkpoints.resume(actors, fleet, start) if start.buffer is not None else 0
        await train(config, env, actors, fleet, checkpoints, progress, first_batch, metrics)
        checked = await end_on_average(config, env, actors, fleet) if config.trainer.ema_decay else {}
        final_policy = await checkpoints.save_policy(actors, "final_policy", config.run.steps)
        final, final_row = await fleet.evaluate(RolloutSettings.of(config), final=True)
        await fleet.settle()
        log.info("final policy: %s", final_policy)
        summary = summarize(run, env, actors, fleet, progress, final, {**final_row, **checked})
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
        summary = asyncio.run(run_job(run, env, model_dir, Checkpoints(run).restore()))
    # One line: the numbers and the run's own lists; an env's per-state or per-task ones stay in eval.json.
    print(json.dumps({k: v for k, v in summary.items()
                      if not isinstance(v, (list, dict)) or k in ("pictures", "policy_versions", "engines_lost")}))
    return summary


if __name__ == "__main__":
    run_cli(main, "grpo", (ModelError,))
