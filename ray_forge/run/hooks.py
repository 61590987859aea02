"""What runs around a GRPO step, each part deciding when from ``core.cadence.every``: the
checkpoint, the sync check and evaluation (which run while the next batch comes in), the chaos
that kills actors and nodes, and the run's end on the moving average of its weights."""

from __future__ import annotations

import asyncio
import time

from ray_forge.actors.launch import Actors
from ray_forge.actors.rollout import RolloutSettings
from ray_forge.config.schema import JobConfig
from ray_forge.core.cadence import every
from ray_forge.core.checkpoint import CheckpointManager
from ray_forge.core.env import EnvSetup
from ray_forge.observe.metrics import MetricsLog, timed
from ray_forge.run.chaos import NodeChaos, chaos_monkey
from ray_forge.run.recorder import Recorder
from ray_forge.run.rollouts import Background, Rollouts


class StepHooks:
    def __init__(self, config: JobConfig, env: EnvSetup, actors: Actors, fleet, checkpoints: CheckpointManager,
                 recorder: Recorder, metrics: MetricsLog) -> None:
        self.config, self.env, self.actors, self.fleet = config, env, actors, fleet
        self.checkpoints, self.recorder, self.metrics = checkpoints, recorder, metrics
        self.settings = RolloutSettings.of(config)
        self.closing: asyncio.Task | None = None
        # Checked now, before the run starts: a node kill that could never happen is a config error.
        self.lose_nodes = NodeChaos(config.chaos.kill_nodes, actors.by_name()) if config.chaos.kill_nodes else None

    def background(self) -> list[Background]:
        """Chaos: an actor killed about every ``chaos.every_s``, nodes lost at their steps."""
        tasks = [lambda stop: chaos_monkey(self.config.chaos, self.fleet, stop)] if self.config.chaos.every_s else []
        if self.lose_nodes is not None:
            tasks.append(lambda stop: self.lose_nodes.run(self.metrics, stop))
        return tasks

    async def before_training(self, rollouts: Rollouts, step: int) -> None:
        """The starting policy's evaluation (``run.eval_before_train``), as step 0's row."""
        if self.config.run.eval_before_train and step == 0:
            (result, row), eval_s = await rollouts.guard(timed(self.fleet.evaluate(self.settings), "eval_s"),
                                                         "the evaluation before training")
            await self.recorder.keep(0, result, row)
            self.metrics.log(0, **row, **eval_s)

    async def after_step(self, rollouts: Rollouts, step: int, row: dict, started: float) -> None:
        """The checkpoint now, before the next batch leaves the buffer; the sync check and the
        evaluation while it comes in (``closed`` waits for them). Raced against the guards too: an
        evaluation waiting for a lost engine must not keep a lost trainer unnoticed."""
        saved_s = await self.checkpoints.save(step, last_step=step == self.config.run.steps)
        if saved_s is not None:
            row["checkpoint_s"] = saved_s
        self.closing = rollouts.spawn(self._close(step, row, started), f"step {step} closed")
        if self.config.run.keep_best:  # a best policy is saved from the trainer, before it trains on
            await self.closed()

    async def closed(self) -> None:
        """Once the last step's sync check, evaluation and metrics row are done."""
        if self.closing is not None:
            await self.closing

    async def _close(self, step: int, row: dict, started: float) -> None:
        """Reads the trainer and the first engine up as step ``step`` left them: the next step
        trains and syncs only after this."""
        run = self.config.run
        (checked, check_s), (evaluated, eval_s) = await asyncio.gather(
            timed(self.check_sync(step) if every(run.sync_check_every, step) else None, "sync_check_s"),
            timed(self.fleet.evaluate(self.settings) if run.eval_every and every(run.eval_every, step, run.steps) else None,
                  "eval_s"))
        row.update(**(checked or {}), **check_s)
        if evaluated is not None:
            result, eval_row = evaluated
            row.update(eval_row, **eval_s)
            await self.recorder.keep(step, result, eval_row)
        await self.fleet.roll_call()  # a member restarted while idle counts too
        row.update(self.fleet.stats(), step_time_s=time.monotonic() - started)  # the restarts and kills until now
        self.metrics.log(step, **row)
        self.metrics.advance(reward=row["train_reward"], eval=row.get("eval_return"), loss=row.get("loss"))

    async def check_sync(self, version: int) -> dict:
        """The first engine up against the trainer on the env's probe prompts."""
        run = self.config.run
        return await self.fleet.check_sync(self.actors.trainer, self.env.probe_prompts(), seed=run.seed + version,
                                           count=run.sync_check_prompts, tolerance=run.sync_check_tolerance)

    async def finish(self) -> tuple[dict, dict]:
        """The run's end: on the moving average of its weights (``trainer.ema_decay``), which the
        engines load as one more version and the first engine up is checked against; the final
        policy saved; its evaluation (the whole result, and its row)."""
        checked, steps = {}, self.config.run.steps
        if self.config.trainer.ema_decay:
            await self.actors.trainer.use_average()
            await self.fleet.sync_weights(self.actors.trainer, self.actors.store.spec, steps + 1)
            checked = await self.check_sync(steps + 1) if self.config.run.sync_check_final else {}
        await self.recorder.save_policy("final_policy", steps)
        final, final_row = await self.fleet.evaluate(self.settings, final=True)
        return final, {**final_row, **checked}
