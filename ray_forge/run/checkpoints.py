"""A GRPO run's checkpoints, as its driver sees them: what it saves besides the trainer's shards and
the buffer's games, and how a resumed run comes back to the step of its newest checkpoint.

Saving: every trainer rank writes its shards, the buffer its games and rollout position, then the
driver's ``Progress`` and RNG state; the checkpoint is made visible atomically
(``ray_forge/core/checkpoint.py``). Resuming: before any actor starts, the RNG state comes back,
metrics rows after the checkpoint are cut off (the resumed run writes them again), and a best
policy saved after it is removed; once the actors are up, the trainer and the buffer load theirs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import shutil
import time
from pathlib import Path

import ray
import torch

from ray_forge.actors.launch import Actors
from ray_forge.core import checkpoint
from ray_forge.core.checkpoint import CheckpointError
from ray_forge.models.export import SAVED_STEP, save_hf_folder
from ray_forge.remote import call, last_line
from ray_forge.run.directory import EVALUATIONS_DIR, Run, truncate_metrics
from ray_forge.run.fleet import Fleet, FleetError

log = logging.getLogger(__name__)

BEST_POLICY = "best_policy"
METRICS = "metrics.jsonl"


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


@dataclasses.dataclass(frozen=True)
class Restored:
    """Where a run starts: at step 0, or from its newest checkpoint."""

    progress: Progress
    buffer: dict | None
    """What the driver kept of the buffer's state (its rollout position); None for a fresh start."""
    wall_s: float
    """Wall time of the last metrics row kept: the resumed run's clock goes on from it."""


class Checkpoints:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.run_dir = run.run_dir
        self.config = run.config

    # -- before the actors ---------------------------------------------------------------------
    def restore(self) -> Restored:
        """The run's starting point; for a resumed run, its files brought back to the checkpoint's step."""
        if self.run.resume_from is None:
            if self.run.resumed:  # stopped before its first checkpoint: start it again from step 0
                log.warning("%s has no usable checkpoint: starting it again from step 0", self.run_dir)
            return Restored(Progress(), None, truncate_metrics(self.run_dir, -1) if self.run.resumed else 0.0)
        saved = checkpoint.read_driver_state(self.run.resume_from)
        random.setstate(saved["rng"]["python"])
        torch.set_rng_state(saved["rng"]["torch"])
        progress = Progress(**{f.name: saved[f.name] for f in dataclasses.fields(Progress)})
        wall_s = truncate_metrics(self.run_dir, progress.step, progress.row)
        self._drop_later_best(progress)
        return Restored(progress, saved["buffer"], wall_s)

    def _drop_later_best(self, progress: Progress) -> None:
        best = self.run_dir / BEST_POLICY
        if best.is_dir() and json.loads((best / SAVED_STEP).read_text())["step"] != progress.best.get("step"):
            log.warning("%s holds weights of a step after the checkpoint: removed (the next better evaluation "
                        "saves it again)", best)
            shutil.rmtree(best)

    # -- with the actors -----------------------------------------------------------------------
    async def resume(self, actors: Actors, fleet: Fleet, start: Restored) -> int:
        """The trainer, the buffer and the fleet's counts from the checkpoint, then the engines
        synced to the restored weights; returns the next batch to play."""
        version, next_batch = await self._load(actors, start.progress, start.buffer)
        fleet.counters.load_state_dict(start.progress.counts)
        await fleet.sync_weights(actors.trainer, actors.store.spec, version)
        if fleet.serving != version:  # rollouts wait for the restored version: none would ever start
            raise FleetError(f"the restored weights (version {version}) reached no engine; see the errors above")
        return next_batch

    async def _load(self, actors: Actors, progress: Progress, buffer: dict) -> tuple[int, int]:
        """The trainer's shards and the buffer's games; returns (the weights' version, the next batch)."""
        folder = self.run.resume_from
        try:
            version = await actors.trainer.load_checkpoint(str(folder))
        except ray.exceptions.RayTaskError as err:
            raise CheckpointError(f"{folder} could not be loaded: {last_line(err)}; move it aside to resume "
                                  "from the one before") from None
        if version != progress.step:
            raise CheckpointError(f"{folder}: the trainer's shards are at version {version}, "
                                  f"the driver's state at step {progress.step}")
        buffered = await call(actors.buffer.load.remote(str(folder / checkpoint.BUFFER_STATE)), timeout_s=60,
                              what="buffer.load")
        log.info("resumed %s from %s: step %d, policy version %d, %d games buffered, next batch %d", self.run_dir,
                 folder.name, progress.step, version, buffered, buffer["next_batch"])
        return version, buffer["next_batch"]

    async def save(self, actors: Actors, progress: Progress) -> float:
        """Trainer shards (every rank), then the buffer and rollout position in one call, then the
        driver's state; made visible atomically. Returns seconds."""
        start = time.monotonic()
        staging = await asyncio.to_thread(checkpoint.staging_dir, self.run_dir, progress.step)
        try:
            await actors.trainer.save_checkpoint(str(staging))
        except ray.exceptions.RayTaskError as err:  # a rank could not write its shards (a full disk, ...)
            raise checkpoint.failed(self.run_dir, progress.step, staging, RuntimeError(last_line(err))) from None
        # The buffer writes its games into the checkpoint itself; the driver keeps its position.
        buffer = await call(actors.buffer.save.remote(str(staging / checkpoint.BUFFER_STATE)), timeout_s=60,
                            what="buffer.save")
        driver = dict(dataclasses.asdict(progress), buffer=buffer, policy_version=progress.step,
                      rng=dict(python=random.getstate(), torch=torch.get_rng_state()))
        expected = [checkpoint.DCP_METADATA, checkpoint.BUFFER_STATE] + [
            checkpoint.rank_file(r) for r in range(self.config.trainer.num_ranks)]
        await asyncio.to_thread(checkpoint.commit, self.run_dir, progress.step, staging, driver,
                                self.config.run.keep_checkpoints, expected)
        return time.monotonic() - start

    async def keep_evaluation(self, actors: Actors, progress: Progress, step: int, result: dict,
                              row: dict) -> None:
        """An evaluation's whole result in ``evaluations/step-<N>.json`` (its metrics ``row`` goes in
        the metrics); with ``run.keep_best``, the trainer's weights as the best policy when it is
        the best evaluation yet of the weights the trainer holds."""
        folder = self.run_dir / EVALUATIONS_DIR
        folder.mkdir(exist_ok=True)
        (folder / f"step-{step:05d}.json").write_text(json.dumps(result, indent=1))
        progress.evals.append(dict(row, step=step))
        # The best policy is saved from the trainer: only an evaluation of the same weights may pick it.
        if (self.config.run.keep_best and step and row["eval_policy_version"] == step
                and row["eval_return"] > progress.best.get("eval_return", float("-inf"))):
            progress.best = dict(row, step=step)
            await self.save_policy(actors, BEST_POLICY, step)

    async def save_policy(self, actors: Actors, name: str, step: int) -> Path:
        """The trainer's weights as a self-contained HF folder ``name`` in the run directory."""
        out_dir = self.run_dir / name
        await save_hf_folder(actors.trainer, actors.model_dir, out_dir, step, self.config.trainer.dtype)
        return out_dir
