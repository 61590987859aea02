"""The rollout side of a GRPO run: batches of games played ahead into the replay buffer while the
trainer takes them one step at a time.

``Rollouts`` is an async context manager: on entry it starts playing from the run's next batch and
watching the trainer (a lost trainer node stops the run at once, not at its next call); on exit it
stops both, with the background tasks it was given (chaos) and the step closes it ran. A batch
starts as soon as it is at most ``buffer.max_policy_lag`` batches ahead of the weights every live
engine serves, even while the one before is in play (the engines batch the turns of both): the
scheduler wakes when a batch ends, when the served version moves, or when the run stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray_forge.actors.launch import Actors
from ray_forge.actors.rollout import RolloutSettings, batch_groups
from ray_forge.config.schema import JobConfig
from ray_forge.remote import REPLY_SLACK_S, call

log = logging.getLogger(__name__)
T = TypeVar("T")

Background = Callable[[asyncio.Event], Awaitable[None]]
"""A task that runs as long as the rollouts, until the event (the run's stop) is set."""


class Rollouts:
    def __init__(self, config: JobConfig, actors: Actors, fleet, first_batch: int,
                 background: list[Background] = ()) -> None:
        self.config, self.actors, self.fleet = config, actors, fleet
        self.settings = RolloutSettings.of(config)
        self.lag = config.buffer.max_policy_lag
        self.first_batch = self.next_to_play = first_batch
        self.stop = asyncio.Event()
        self.played: set[int] = set()
        """Batches wholly in the buffer (``buffer.fixed_lag`` waits for them)."""
        self._progress = asyncio.Condition()
        self._background = list(background)
        self._spawned: list[asyncio.Task] = []
        self._tokens = self._games = 0
        self._busy_s, self._busy_since = 0.0, None
        self._batch_s: list[float] = []

    async def __aenter__(self) -> Rollouts:
        self._loop = asyncio.create_task(self._play_ahead())
        self._watch = asyncio.create_task(self.actors.trainer.watch())
        self.guards = (self._loop, self._watch)
        self._background = [asyncio.create_task(task(self.stop)) for task in self._background]
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._loop.cancel()  # the run stops: its games in play are not waited for (a resumed run plays them)
        self.stop.set()
        for task in (self._watch, *self._spawned):  # a step close's error is the run's own, raised already
            task.cancel()
        await asyncio.gather(self._watch, *self._spawned, return_exceptions=True)
        try:
            await asyncio.wait_for(asyncio.gather(self._loop, *self._background, return_exceptions=True),
                                   timeout=self.settings.play_limit_s)  # the games in play end within it
        except Exception as err:  # the loop's own error was raised already by ``next_batch``
            log.debug("rollout loop ended: %s", err)

    async def next_batch(self, step: int) -> tuple[dict, object]:
        """Step ``step``'s games, made into samples by the buffer, which also computes their GRPO
        advantages (``core.algorithm.group_advantages``): their statistics, and a reference to the
        samples, which the trainer fetches itself."""
        config = self.config
        limit_s = 2 * self.settings.play_limit_s  # a backstop: every rollout call has its own timeout
        batch = await self.guard(call(
            self.actors.buffer.wait_batch.remote(config.grpo.games_per_step, step - 1, config.trainer.merge_identical,
                                                 limit_s, config.grpo.scale_rewards, config.grpo.baseline),
            timeout_s=limit_s + REPLY_SLACK_S, what="buffer.wait_batch"), "training finished")
        if batch is None:
            raise TimeoutError(f"no training batch within {limit_s:.0f}s")
        return batch

    async def played_through(self, step: int) -> None:
        """With ``buffer.fixed_lag``, until every batch that step ``step``'s weights must not reach is
        in the buffer; at once otherwise."""
        if not self.config.buffer.fixed_lag:
            return
        batches = range(self.first_batch, step + self.lag)

        async def all_played() -> None:
            async with self._progress:
                await self._progress.wait_for(lambda: self.played.issuperset(batches))

        await self.guard(all_played(), "its batches were played")

    def guard(self, work: Awaitable[T], what: str) -> Awaitable[T]:
        """``work``'s result, unless the rollout loop or the trainer's watch fails first."""
        return beside(self.guards, work, what)

    def spawn(self, work: Awaitable, what: str) -> asyncio.Task:
        """``work`` in the background, guarded; cancelled on exit if still running."""
        task = asyncio.create_task(self.guard(work, what))
        self._spawned.append(task)
        return task

    def rates(self) -> dict[str, float | None]:
        """The rollout's rates for a metrics row; starts the next row's batch times."""
        batch_s, self._batch_s = self._batch_s, []
        busy_s = max(self._busy_s + (time.monotonic() - self._busy_since if self._busy_since else 0.0), 1e-9)
        return dict(rollout_batch_s=sum(batch_s) / len(batch_s) if batch_s else None,
                    tokens_per_s=self._tokens / busy_s, episodes_per_s=self._games / busy_s)

    async def _play_ahead(self) -> None:
        """Starts batches while they may run ahead; after ``stop``, finishes those in play."""
        playing: set[asyncio.Task] = set()
        try:
            while not self.stop.is_set() or playing:
                if not self.stop.is_set() and self.next_to_play <= self.fleet.serving + self.lag:
                    self._busy_since = self._busy_since or time.monotonic()
                    playing.add(asyncio.create_task(self._play(self.next_to_play)))
                    self.next_to_play += 1
                    continue
                for task in await self._woken(playing):
                    playing.discard(task)
                    task.result()  # a batch that failed on every pair stops the run
                if not playing and self._busy_since is not None:
                    self._busy_s += time.monotonic() - self._busy_since
                    self._busy_since = None
        finally:
            for task in playing:
                task.cancel()
            await asyncio.gather(*playing, return_exceptions=True)  # one that ended on an error meanwhile is not news

    async def _woken(self, playing: set[asyncio.Task]) -> set[asyncio.Task]:
        """Waits for a batch to end, the served version to let the next start, or the stop; returns
        the batches that ended."""
        wakers = set()
        if not self.stop.is_set():
            wakers = {asyncio.create_task(self.fleet.until_serving(self.next_to_play - self.lag)),
                      asyncio.create_task(self.stop.wait())}
        try:
            done, _ = await asyncio.wait(playing | wakers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waker in wakers:
                waker.cancel()
        return done & playing

    async def _play(self, batch: int) -> None:
        """Batch ``batch``'s groups, split over the env actors and engines: only counts come back."""
        start = time.monotonic()
        groups = batch_groups(self.config.run.seed, batch, self.config.grpo.prompts_per_step)
        chunks = max(len(self.actors.policies), len(self.actors.envs))
        counts = await asyncio.gather(*(
            self.fleet.play(i, groups[i::chunks], self.settings, key=batch * chunks + i,
                            sink=(self.actors.buffer, batch, i, chunks))
            for i in range(chunks)))
        self._tokens += sum(c["tokens"] for c in counts)
        self._games += sum(c["games"] for c in counts)
        self._batch_s.append(time.monotonic() - start)
        async with self._progress:
            self.played.add(batch)
            self._progress.notify_all()


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
