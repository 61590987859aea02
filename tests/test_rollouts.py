"""The rollout scheduler without a cluster: batches start as far ahead of the served weights as
the lag allows, wake on events (a batch ended, the served version moved, the stop), never on a
clock, and finish what is in play when the run stops."""

from __future__ import annotations

import ast
import asyncio
import types
from pathlib import Path

from ray_forge.config import load_config
from ray_forge.config.schema import JobConfig

ROOT = Path(__file__).resolve().parent.parent


class _Fleet:
    """Serves a version the test moves; a play ends when the test releases its batch."""

    def __init__(self) -> None:
        self.serving = 0
        self.started: list[int] = []
        self.release: dict[int, asyncio.Event] = {}
        self._moved = asyncio.Event()

    async def play(self, chunk, groups, settings, key, sink) -> dict:
        batch = sink[1]
        self.started.append(batch)
        await self.release.setdefault(batch, asyncio.Event()).wait()
        return dict(games=len(groups) * settings.group_size, tokens=1)

    def serve(self, version: int) -> None:
        self.serving = version
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    async def until_serving(self, version: int) -> None:
        while self.serving < version:
            await self._moved.wait()

    def finish(self, batch: int) -> None:
        self.release.setdefault(batch, asyncio.Event()).set()


async def _watch() -> None:
    await asyncio.Event().wait()  # a trainer that stays alive


async def _until(holds) -> None:
    for _ in range(500):
        if holds():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 5 s")


def test_batches_run_as_far_ahead_as_the_lag_allows_and_finish_when_stopped():
    from ray_forge.run.rollouts import Rollouts

    config = load_config(JobConfig, None, ["env.name=blackjack", "buffer.max_policy_lag=1"])
    actors = types.SimpleNamespace(policies=[object()], envs=[object()], buffer=None,
                                   trainer=types.SimpleNamespace(watch=_watch))

    async def scenario() -> None:
        fleet = _Fleet()
        rollouts = await Rollouts(config, actors, fleet, first_batch=0).__aenter__()
        stop = None
        try:
            await _until(lambda: fleet.started == [0, 1])  # version 0 serves batches 0 and 1
            await asyncio.sleep(0.2)
            assert fleet.started == [0, 1]  # batch 2 waits for version 1, however long
            fleet.finish(0)
            await _until(lambda: 0 in rollouts.played)
            assert fleet.started == [0, 1]  # a batch ending is no new version
            fleet.serve(1)
            await _until(lambda: fleet.started == [0, 1, 2])
            rates = rollouts.rates()
            assert rates["rollout_batch_s"] > 0 and rates["episodes_per_s"] > 0
            stop = asyncio.create_task(rollouts.__aexit__(None, None, None))
            await asyncio.sleep(0.2)
            assert not stop.done()  # the batches in play are finished, not dropped
            fleet.finish(1), fleet.finish(2)
            await asyncio.wait_for(stop, timeout=5)
            assert rollouts.played == {0, 1, 2} and fleet.started == [0, 1, 2]
        finally:
            if stop is None:
                await rollouts.__aexit__(RuntimeError, None, None)  # a failed check: cancel what is in play

    asyncio.run(scenario())


def test_the_scheduler_never_sleeps_or_polls():
    """Nothing in the rollout pipeline waits on a clock: no sleep, no wait with a timeout."""
    tree = ast.parse((ROOT / "ray_forge/run/rollouts.py").read_text())
    clocked = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
               and (ast.unparse(node.func).endswith("sleep")
                    or (ast.unparse(node.func) == "asyncio.wait" and any(k.arg == "timeout" for k in node.keywords)))]
    assert clocked == []
