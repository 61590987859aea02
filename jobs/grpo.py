"""GRPO post-training of an LLM on a text env (BlackJack, or coding and math tasks), on Ray,
with vLLM policies and a TorchTitan trainer.

Local (starts an embedded Ray cluster; dashboard at http://127.0.0.1:8265):
    python jobs/grpo.py --config jobs/configs/blackjack_tiny.yaml run.steps=60 trainer.lr=3e-5
    python jobs/grpo.py --config jobs/configs/code_tiny.yaml
Against a running cluster:
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/grpo.py --config jobs/configs/blackjack_tiny.yaml run.steps=5

Resume a run that was stopped (a killed driver, a restarted pod) from its newest checkpoint:
    python jobs/grpo.py --resume runs/blackjack-tiny-20261201-101500
    python jobs/grpo.py --config jobs/configs/blackjack_tiny.yaml --resume auto   # latest unfinished run, else fresh

Flow: config -> actors (resumed: trainer, buffer and rollout position restored, engines synced)
-> rollout and training loops running concurrently -> weight sync after every step -> periodic
greedy evaluation -> a checkpoint every ``run.checkpoint_every`` steps -> final policy saved as
an HF folder -> shutdown. Env actors and engines that die are restarted by Ray and their games
replayed (``ray_forge/run/fleet.py``); ``chaos.every_s`` kills some on purpose.
The env (``env.name``, a spec in ``envs/registry.py``) decides, besides its games: the texts a
tiny model's tokenizer is trained on, the prompts of the sync check, the evaluation (run by
env-0, beside its envs: BlackJack's exact return of the greedy decision table; code's greedy pass
rate over every task, scored by its sandbox), and the PNGs the run ends with.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import shutil
import sys
import time
from pathlib import Path

import ray
import torch

from envs import registry
from ray_forge.actors.buffer import COUNTERS
from ray_forge.actors.launch import Actors, start_actors
from ray_forge.actors.rollout import RolloutSettings, batch_groups
from ray_forge.cluster import pools
from ray_forge.config import ConfigError
from ray_forge.config.schema import JobConfig
from ray_forge.core import checkpoint
from ray_forge.core.checkpoint import CheckpointError
from ray_forge.core.env import EnvSetup
from ray_forge.models.tiny import ModelError, check_model_dir, make_tiny_qwen3
from ray_forge.observe.metrics import MetricsLog, metrics_row, read_metrics
from ray_forge.remote import RemoteCallError, call, computed, get
from ray_forge.run import sync_check
from ray_forge.run.chaos import chaos_monkey
from ray_forge.run.directory import EVALUATIONS_DIR, FINISHED_FILE, Run, create, open_run, truncate_metrics
from ray_forge.run.export import SAVED_STEP, save_hf_folder
from ray_forge.run.fleet import Fleet, FleetError
from ray_forge.weights import WeightSyncError

log = logging.getLogger("grpo")


@dataclasses.dataclass
class LoopState:
    """Shared by the loops (one event loop, so no locks)."""

    trainer_version: int = 0
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    generated_tokens: int = 0
    played_games: int = 0
    rollout_seconds: float = 0.0
    batch_seconds: list[float] = dataclasses.field(default_factory=list)
    """How long each batch finished since the last metrics row was in play."""
    chaos_kills: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Progress:
    """The driver's part of a checkpoint (the trainer and the buffer save their own)."""

    step: int = 0
    best: dict = dataclasses.field(default_factory=dict)
    """The best evaluation so far and its step (``run.keep_best``)."""
    evals: list[dict] = dataclasses.field(default_factory=list)
    """Every evaluation's metrics row, with its step."""
    row: dict = dataclasses.field(default_factory=dict)
    """The metrics row of ``step``, written again on resume if the kill came before it was."""
    counts: dict = dataclasses.field(default_factory=dict)
    """The fleet's restart and replay counts and the chaos kills, carried across resumes."""


CARRIED = ("actor_restarts", "replayed_games", "chaos_kills")
"""Counts since the run began, kept in ``Progress.counts`` across resumes."""


async def rollout_loop(config: JobConfig, actors: Actors, fleet: Fleet, state: LoopState, batch: int) -> None:
    """Hands out batches of seeds to the rollout workers (the env actors), which play them against
    the policy engines and put the scored groups into the buffer: only counts come back here.

    Starts at batch ``batch`` (the buffer's saved position on resume). A batch starts as soon as
    it is at most ``buffer.max_policy_lag`` batches ahead of the weights the engines hold, even
    while the one before is still in play: the engines batch the turns of both. With a lag of 0
    every batch is played by the newest weights only. Stops when ``state.stop`` is set, after
    the batches in play.
    """
    settings = RolloutSettings.of(config)
    num_groups = config.grpo.games_per_step // config.grpo.group_size
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

    try:
        while not state.stop.is_set() or playing:
            # Rollout time: the time some batch was in play (the rates in the metrics divide by it).
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


async def next_batch(config: JobConfig, actors: Actors, state: LoopState,
                     rollout: asyncio.Task) -> tuple[dict, ray.ObjectRef]:
    """The next ``games_per_step`` games, made into samples by the buffer: (their statistics, a
    reference to the samples, which the trainer fetches itself); fails if the rollout loop died."""
    # A backstop only: every call of the rollout has its own timeout, and a batch may need a
    # generate and a step per turn, and a replay after a restart, before it is in the buffer.
    limit_s = 2 * RolloutSettings.of(config).play_limit_s
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if rollout.done():
            rollout.result()  # re-raises the rollout's error
            raise RuntimeError("rollout loop stopped before training finished")
        batch = await call(actors.buffer.sample_batch.remote(config.grpo.games_per_step, state.trainer_version,
                                                             config.trainer.merge_identical),
                           timeout_s=60, what="buffer.sample_batch")
        if batch is not None:
            return batch
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no training batch within {limit_s:.0f}s")


async def sync_weights(actors: Actors, fleet: Fleet, version: int) -> dict[str, float]:
    """The trainer ranks put ``version`` in the weight store while every live policy takes it: each
    fetches it off its step loop and loads it between two engine steps (generation pauses for
    the load, not for the requests in flight). How the bytes travel is the weight store's business.

    Returns seconds: the whole sync, the trainer's publish, and the slowest engine's fetch, load,
    time generation stood still (``gen_paused_s``) and wait for the step loop to take the load."""
    start = time.monotonic()
    publish_s, engines = await asyncio.gather(actors.trainer.publish_weights(actors.store.spec, version),
                                              fleet.sync(actors.store.spec, version))
    return {"weight_sync_s": time.monotonic() - start, "weight_publish_s": publish_s,
            "weight_fetch_s": engines.get("fetch_s", 0.0), "weight_load_s": engines.get("load_s", 0.0),
            "gen_paused_s": engines.get("paused_s", 0.0), "weight_wait_s": engines.get("waited_s", 0.0)}


async def check_sync(config: JobConfig, env: EnvSetup, actors: Actors, fleet: Fleet, step: int) -> dict:
    """policy-0 against the trainer on the env's probe prompts, right after the sync of ``step``;
    nothing (and a warning) when policy-0 is down: it is compared again at the next check."""
    if fleet.down("policy-0"):
        log.warning("step %d: policy-0 is restarting; the sync check waits for the next one", step)
        return {}
    try:
        if (held := await call(actors.policies[0].get_version.remote(), timeout_s=60,
                               what="policy-0.get_version")) != step:
            log.warning("step %d: policy-0 holds version %d (a sync failed or it restarted); the sync check waits "
                        "for the next one", step, held)
            return {}
        return await sync_check.check(actors.policies[0], actors.trainer, env.probe_prompts(),
                                      seed=config.run.seed + step, tolerance=config.run.sync_check_tolerance,
                                      timeout_s=config.policy.call_timeout_s)
    except RemoteCallError as err:
        if not err.died:
            raise
        log.warning("%s; the sync check waits for the next one", err)
        fleet.recover(err.actor)
        return {}


async def evaluate(config: JobConfig, actors: Actors, fleet: Fleet, final: bool = False) -> tuple[dict, dict]:
    """The env's greedy evaluation of policy-0, run by env-0 (``final``: the end-of-run one): its
    whole result, and its metrics-row fields; if an actor it uses dies, again once it is back."""
    for attempt in range(3):
        await fleet.ready("policy-0")
        await fleet.ready("env-0")
        try:
            # No sync runs during an evaluation (both are steps of the training loop), so this is
            # the version evaluated; a restarted engine may be behind.
            version = await call(actors.policies[0].get_version.remote(), timeout_s=60, what="policy-0.get_version")
            if version != fleet.version:
                log.warning("policy-0 holds weights version %d, not %d (it missed a sync): evaluating what it holds",
                            version, fleet.version)
            metrics, result = await call(
                actors.envs[0].evaluate.remote(actors.policies[0], "policy-0", final, config.policy.call_timeout_s,
                                               RolloutSettings.of(config)),
                timeout_s=RolloutSettings.of(config).play_limit_s, what="env-0.evaluate")
            row = {f"eval_{name}": value for name, value in metrics.items()}
            return dict(result, policy_version=version), dict(row, eval_policy_version=version)
        except RemoteCallError as err:
            if not err.died or err.actor not in fleet.members or attempt == 2:
                raise
            log.warning("%s; evaluating again once it is back", err)
            fleet.recover(err.actor)
    raise AssertionError("unreachable")


def keep_evaluation(run_dir: Path, step: int, result: dict) -> None:
    """Every evaluation's whole result (its episodes, for an env that keeps them), beside the
    metrics row that has its numbers: ``evaluations/step-<N>.json``."""
    folder = run_dir / EVALUATIONS_DIR
    folder.mkdir(exist_ok=True)
    (folder / f"step-{step:05d}.json").write_text(json.dumps(result, indent=1))


async def timed(work, key: str) -> tuple[object, dict[str, float]]:
    """(what the awaitable ``work`` returns, {key: seconds it took}); (None, {}) for no work."""
    if work is None:
        return None, {}
    start = time.monotonic()
    result = await work
    return result, {key: time.monotonic() - start}


def _inner(err: ray.exceptions.RayTaskError) -> str:
    """The remote error's last line (DCP wraps a rank's OSError in its own exception)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else err.__class__.__name__


def accounting(buffer_stats: dict[str, int], fleet: Fleet, state: LoopState, carried: dict) -> dict[str, int]:
    """Game counts since the run began: generated = trained + evicted + dropped + still buffered;
    restarts, replays and chaos kills, with ``carried`` from before a resume added."""
    row = dict(buffer_stats, **{k: v + carried.get(k, 0) for k, v in fleet.stats().items()
                                if k in CARRIED},
               chaos_kills=len(state.chaos_kills) + carried.get("chaos_kills", 0))
    row["buffer_size"] = row.pop("buffer_games")
    accounted = sum(row[k] for k in COUNTERS[1:]) + row["buffer_size"]
    if accounted != row["generated"]:
        log.error("game accounting is off: %d generated, %d accounted for (%s)", row["generated"], accounted, row)
    return row


async def save_checkpoint(config: JobConfig, actors: Actors, run_dir: Path, progress: Progress) -> float:
    """Trainer shards (every rank), then the buffer and rollout position in one call, then the
    driver's state; made visible atomically (see ``ray_forge/core/checkpoint.py``). Returns seconds."""
    start = time.monotonic()
    staging = await asyncio.to_thread(checkpoint.staging_dir, run_dir, progress.step)
    try:
        await actors.trainer.save_checkpoint(str(staging))
    except ray.exceptions.RayTaskError as err:  # a rank could not write its shards (a full disk, ...)
        raise checkpoint.failed(run_dir, progress.step, staging, RuntimeError(_inner(err))) from None
    # The buffer writes its games into the checkpoint itself; the driver keeps its position.
    buffer_state = await call(actors.buffer.save.remote(str(staging / checkpoint.BUFFER_STATE)), timeout_s=60,
                              what="buffer.save")
    driver = dict(dataclasses.asdict(progress), buffer=buffer_state, policy_version=progress.step,
                  rng=dict(python=random.getstate(), torch=torch.get_rng_state()))
    expected = [checkpoint.DCP_METADATA, checkpoint.BUFFER_STATE] + [checkpoint.rank_file(r)
                                                                     for r in range(config.trainer.num_ranks)]
    await asyncio.to_thread(checkpoint.commit, run_dir, progress.step, staging, driver, config.run.keep_checkpoints,
                            expected)
    return time.monotonic() - start


async def train(config: JobConfig, env: EnvSetup, actors: Actors, fleet: Fleet, run_dir: Path,
                progress: Progress, first_batch: int, wall_offset_s: float) -> None:
    state = LoopState(trainer_version=progress.step)
    metrics = MetricsLog(run_dir, config.run.steps, progress=config.run.progress, done_steps=progress.step,
                         wall_offset_s=wall_offset_s)
    rollout = asyncio.create_task(rollout_loop(config, actors, fleet, state, first_batch))
    chaos = (asyncio.create_task(chaos_monkey(config.chaos, fleet, state.stop, state.chaos_kills))
             if config.chaos.every_s else None)
    carried = dict(progress.counts)
    try:
        if config.run.eval_before_train and progress.step == 0:
            (result, row), eval_s = await timed(evaluate(config, actors, fleet), "eval_s")
            keep_evaluation(run_dir, 0, result)
            progress.evals.append(dict(row, step=0))
            metrics.log(0, **row, **eval_s)
        for step in range(progress.step + 1, config.run.steps + 1):
            step_start = time.monotonic()
            batch_stats, samples = await next_batch(config, actors, state, rollout)
            ref = None
            if actors.reference is not None and batch_stats["num_rows"]:
                ref = actors.reference.logprobs.remote(samples)
                await computed(ref, timeout_s=config.reference.call_timeout_s, what="ref.logprobs")  # for the trainer
            train_start = time.monotonic()
            train_stats = await actors.trainer.train_step(samples, ref)
            train_stats["train_s"] = time.monotonic() - train_start
            state.trainer_version = step
            sync = await sync_weights(actors, fleet, step)
            sync_check_due = bool(config.run.sync_check_every) and step % config.run.sync_check_every == 0
            eval_due = bool(config.run.eval_every) and (step % config.run.eval_every == 0 or step == config.run.steps)
            # Neither changes a weight (the check reads policy-0 and the trainer, the evaluation
            # policy-0 and env-0), and no sync comes until both are done: side by side.
            (checked, check_s), (evaluated, eval_s) = await asyncio.gather(
                timed(check_sync(config, env, actors, fleet, step) if sync_check_due else None, "sync_check_s"),
                timed(evaluate(config, actors, fleet) if eval_due else None, "eval_s"))
            sync.update(checked or {}, **check_s)
            rollout_s = max(state.rollout_seconds, 1e-9)
            buffer_stats = await call(actors.buffer.stats.remote(), timeout_s=60, what="buffer.stats")
            batch_s, state.batch_seconds = state.batch_seconds, []
            row = dict(**batch_stats, **train_stats, **sync,
                rollout_batch_s=sum(batch_s) / len(batch_s) if batch_s else None,
                       tokens_per_s=state.generated_tokens / rollout_s, episodes_per_s=state.played_games / rollout_s,
                       **accounting(buffer_stats, fleet, state, carried))
            if evaluated is not None:
                result, eval_row = evaluated
                keep_evaluation(run_dir, step, result)
                row.update(eval_row, **eval_s)
                progress.evals.append(dict(eval_row, step=step))
                # The best policy is saved from the trainer: only an evaluation of the same weights may pick it.
                if (config.run.keep_best and eval_row["eval_policy_version"] == step
                        and eval_row["eval_return"] > progress.best.get("eval_return", float("-inf"))):
                    progress.best = dict(eval_row, step=step)
                    await save_policy(actors, actors.model_dir, run_dir / "best_policy", step, config.trainer.dtype)
            progress.step, progress.row = step, row
            if step == config.run.steps or (config.run.checkpoint_every and step % config.run.checkpoint_every == 0):
                progress.counts = {k: row[k] for k in CARRIED}
                row["checkpoint_s"] = await save_checkpoint(config, actors, run_dir, progress)
            row["step_time_s"] = time.monotonic() - step_start
            metrics.log(step, **row)
            metrics.advance(reward=row["train_reward"], eval=row.get("eval_return"), loss=row.get("loss"))
    finally:
        state.stop.set()
        metrics.close()
        try:
            await asyncio.wait_for(asyncio.gather(rollout, *([chaos] if chaos else [])),
                                   timeout=config.policy.call_timeout_s)
        except Exception as err:  # the rollout's own error was already raised by next_batch
            log.debug("rollout loop ended: %s", err)


async def save_policy(actors: Actors, model_dir: str, out_dir: Path, step: int, dtype: str) -> None:
    """The current trainer weights as a self-contained HF folder (``ray_forge/run/export.py``)."""
    await save_hf_folder(actors.trainer, model_dir, out_dir, step, dtype)




def prepare_model(config: JobConfig, env: EnvSetup, run_dir: Path) -> str:
    """The base model: ``model.path``, or a tiny one made in the run directory (kept on resume,
    so the reference model and a restarted engine start from the same weights as before)."""
    if config.model.path:
        return str(check_model_dir(config.model.path))
    made = run_dir / "initial_model"
    if (made / "config.json").is_file():
        return str(check_model_dir(made))
    return str(make_tiny_qwen3(made, env.corpus(), config.model.tiny, chat=config.env.episode.mode == "sequence"))


def restore_progress(run: Run) -> tuple[Progress, dict | None, float]:
    """(driver progress, buffer state, wall time of the last kept row) of a resumed run."""
    if run.resume_from is None:
        if run.resumed:  # stopped before its first checkpoint: start it again from step 0
            log.warning("%s has no usable checkpoint: starting it again from step 0", run.run_dir)
        return Progress(), None, truncate_metrics(run.run_dir, -1) if run.resumed else 0.0
    saved = checkpoint.read_driver_state(run.resume_from)
    random.setstate(saved["rng"]["python"])
    torch.set_rng_state(saved["rng"]["torch"])
    progress = Progress(**{f.name: saved[f.name] for f in dataclasses.fields(Progress)})
    wall = truncate_metrics(run.run_dir, progress.step)
    best = run.run_dir / "best_policy"
    if best.is_dir() and json.loads((best / SAVED_STEP).read_text())["step"] != progress.best.get("step"):
        log.warning("%s holds weights of a step after the checkpoint: removed (the next better evaluation "
                    "saves it again)", best)
        shutil.rmtree(best)
    rows = read_metrics(run.run_dir / "metrics.jsonl") if (run.run_dir / "metrics.jsonl").exists() else []
    if not rows or rows[-1]["step"] != progress.step:
        # The kill came between the checkpoint and its metrics row: write the row from the checkpoint.
        with (run.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(metrics_row(progress.step, wall, progress.row)) + "\n")
    return progress, saved["buffer"], wall


async def resume(actors: Actors, fleet: Fleet, run: Run, run_step: int, buffer_state: dict) -> int:
    """Trainer and buffer from the checkpoint, then the engines onto the restored weights; returns the next batch."""
    try:
        version = await actors.trainer.load_checkpoint(str(run.resume_from))
    except ray.exceptions.RayTaskError as err:
        raise CheckpointError(f"{run.resume_from} could not be loaded: {_inner(err)}; move it aside to resume "
                              "from the one before") from None
    if version != run_step:
        raise CheckpointError(f"{run.resume_from}: the trainer's shards are at version {version}, "
                              f"the driver's state at step {run_step}")
    if "entries" in buffer_state:  # a checkpoint from before the buffer wrote its own file
        buffered = await call(actors.buffer.load_state.remote(buffer_state), timeout_s=60, what="buffer.load_state")
    else:
        buffered = await call(actors.buffer.load.remote(str(run.resume_from / checkpoint.BUFFER_STATE)),
                              timeout_s=60, what="buffer.load")
    await sync_weights(actors, fleet, version)
    if fleet.serving != version:  # rollouts wait for the restored version: none would ever start
        raise FleetError(f"the restored weights (version {version}) reached no engine; see the errors above")
    log.info("resumed %s from %s: step %d, policy version %d, %d games buffered, next batch %d", run.run_dir,
             run.resume_from.name, run_step, version, buffered, buffer_state["next_batch"])
    return buffer_state["next_batch"]


async def run_job(run: Run, env: EnvSetup, model_dir: str, progress: Progress, buffer_state: dict | None,
                  wall_offset_s: float) -> dict:
    config, run_dir = run.config, run.run_dir
    # A resumed run gets a namespace of its own: the killed attempt's named actors may not be gone yet.
    namespace = run_dir.name + (f"-resumed-{time.strftime('%H%M%S')}" if run.resumed else "")
    started_ray = pools.connect(config.cluster, namespace=namespace)
    actors = None
    try:
        actors = start_actors(config, env, model_dir, store_name=run_dir.name)
        fleet = Fleet(actors.policies, actors.envs, policy_timeout_s=config.policy.call_timeout_s,
                      env_timeout_s=config.env.call_timeout_s)
        await fleet.start()
        first_batch = await resume(actors, fleet, run, progress.step, buffer_state) if buffer_state is not None else 0
        await train(config, env, actors, fleet, run_dir, progress, first_batch, wall_offset_s)
        await save_policy(actors, actors.model_dir, run_dir / "final_policy", config.run.steps, config.trainer.dtype)
        final, final_row = await evaluate(config, actors, fleet, final=True)
        await fleet.settle()
        versions = get([p.get_version.remote() for p in actors.policies], timeout_s=60, what="policy versions")
        route = get(actors.policies[0].weights_route.remote(), timeout_s=60, what="policy-0.weights_route")
        pictures = env.pictures(run_dir, read_metrics(run_dir / "metrics.jsonl"), final)
        summary = dict(final, **final_row, run_dir=str(run_dir), steps=config.run.steps, policy_versions=versions,
                       weight_transport=actors.store.spec.transport, weight_route=route,
                       pictures=[str(p) for p in pictures],
                       best_eval_return=progress.best.get("eval_return"), best_step=progress.best.get("step"))
        (run_dir / FINISHED_FILE).write_text(json.dumps(summary, indent=2))
        log.info("final policy: %s", run_dir / "final_policy")
        return summary
    finally:
        if actors is not None:
            actors.shutdown()
        if started_ray:
            ray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).parent / "configs" / "blackjack_tiny.yaml"))
    parser.add_argument("--resume", metavar="RUN_DIR|auto",
                        help="continue a run from its newest checkpoint; auto: the latest unfinished run of "
                             "this config's run.name, or a fresh run if there is none")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-5 run.steps=20")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run = open_run(args.config, args.overrides, args.resume)
    env = registry.setup(run.config.env)
    if run.config.model.path:  # before the run directory exists: a bad path leaves nothing behind
        check_model_dir(run.config.model.path)
    create(run)
    log.info("run directory: %s%s", run.run_dir.resolve(), " (resumed)" if run.resumed else "")
    try:
        model_dir = prepare_model(run.config, env, run.run_dir)
        progress, buffer_state, wall = restore_progress(run)
        summary = asyncio.run(run_job(run, env, model_dir, progress, buffer_state, wall))
    except RUN_FAULTS as err:
        raise RunStopped(f"{err}; resume with: python jobs/grpo.py --resume {run.run_dir}") from err
    # One line: the numbers and the run's own lists; an env's per-state or per-task ones stay in eval.json.
    print(json.dumps({k: v for k, v in summary.items()
                      if not isinstance(v, (list, dict)) or k in ("pictures", "policy_versions")}))
    return summary


RUN_FAULTS = (RemoteCallError, FleetError, CheckpointError, WeightSyncError, TimeoutError)
"""Faults a run can meet (a dead trainer, a full disk, ...): the run stops, resumable."""


class RunStopped(RuntimeError):
    """A run stopped on an expected fault; the message ends with the command that resumes it."""


def cli() -> None:
    """``main`` for a shell: an expected fault is one line (what, why, how to go on), not a traceback."""
    try:
        main()
    except (RunStopped, ConfigError, ModelError) as err:
        print(f"grpo: error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli()
