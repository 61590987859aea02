"""Which weights each engine holds: the version every engine should hold (the newest synced), what
each said it holds, and the version every live engine serves; weight syncs, and an engine's catch-up
when it is back (restarted, or rejoining after it was lost)."""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from ray_forge.identity import ActorId
from ray_forge.remote import RemoteCallError
from ray_forge.run.fleet.membership import FleetError, Membership
from ray_forge.weights import MixedWeights, StoreSpec, WeightSyncError
from ray_forge.weights.sync import ENGINE_GRACE_S, SyncRound

log = logging.getLogger(__name__)

MAX_FAILED_SYNCS = 3
"""Consecutive weight syncs that may fail (engines keep their version) before the run stops."""


class Versions:
    def __init__(self, membership: Membership, *, lag: int = 1, steps: int | None = None) -> None:
        self.membership = membership
        self.version = 0
        """The policy version every engine should hold: the newest synced (a restarted one is brought to it)."""
        self.failed_syncs = 0
        """Syncs in a row that left some live engine on an older version."""
        self.lag = lag
        """How many versions the served one may fall behind the newest before rollouts starve: they
        play only what the next step can train on (``buffer.max_policy_lag``; 0 with ``buffer.fixed_lag``)."""
        self.steps = steps
        """The run's last step: the versions from it on (its sync's, the average's) feed no rollout."""
        self.held: dict[ActorId, int] = {}
        """The version each engine said it holds after its last update."""
        self.serving = 0
        """The version every live engine holds: ``version`` once its sync has reached them all."""
        self._serving_moved = asyncio.Event()
        """Set (and replaced) each time ``serving`` moves: wakes ``until_serving``."""
        self.spec: StoreSpec | None = None

    async def until_serving(self, version: int) -> None:
        """Return once every live engine serves ``version`` or a newer one; woken each time
        ``serving`` moves, never by a clock."""
        while self.serving < version:
            await self._serving_moved.wait()

    def _note_serving(self) -> bool:
        """Move ``serving`` to ``version`` once every live engine holds it; whether it is there."""
        live = self.membership.engines_up()
        if live and all(self.held.get(name) == self.version for name in live) and self.serving != self.version:
            self.serving = self.version
            moved, self._serving_moved = self._serving_moved, asyncio.Event()
            moved.set()
        return self.serving == self.version

    def _behind(self) -> list[ActorId]:
        """The engines up that do not hold the fleet's version."""
        return [name for name in self.membership.engines_up() if self.held.get(name) != self.version]

    async def held_by(self, name: ActorId) -> int:
        """The version engine ``name`` says it holds now."""
        return await self.membership.calls.call(name, self.membership.members[name].get_version.remote(),
                                                timeout_s=self.membership.timeout_s[name.role], what="get_version")

    async def sync_weights(self, trainer, spec: StoreSpec, version: int) -> dict[str, float]:
        """The trainer ranks (``trainer``, a TrainerGroup) put ``version`` in the weight store while
        every live engine takes it: each fetches it off its step loop and loads it between two
        engine steps (generation pauses for the load, not for the requests in flight). How the
        bytes travel is the weight store's business.

        Returns seconds: the whole sync, the trainer's publish, and the slowest engine's fetch,
        load, time generation stood still (``gen_paused_s``) and wait for the step loop to take the load."""
        start = time.monotonic()
        publish_s, engines = await asyncio.gather(trainer.publish_weights(spec, version), self.sync(spec, version))
        engines = await self._until_servable(spec, version, engines)
        return {"weight_sync_s": time.monotonic() - start, "weight_publish_s": publish_s,
                "weight_fetch_s": engines.get("fetch_s", 0.0), "weight_load_s": engines.get("load_s", 0.0),
                "gen_paused_s": engines.get("paused_s", 0.0), "weight_wait_s": engines.get("waited_s", 0.0)}

    async def _until_servable(self, spec: StoreSpec, version: int, timings: dict[str, float]) -> dict[str, float]:
        """A sync that left the engines up further behind than the rollouts may lag is tried again
        on those behind, from the store: the next step waits for games that only a served version
        can play, and no other sync comes before it (``MAX_FAILED_SYNCS`` in a row stop the run).
        A version the store cannot give again (a push) stops the run, naming it. Engines down are
        synced when they are back."""
        if self.steps is not None and version >= self.steps:
            return timings  # no game will wait for it
        while self.version - self.serving > self.lag and (behind := self._behind()):
            log.warning("weights version %d is fetched again by %s: the rollouts may lag the trainer by %d version(s)",
                        version, ", ".join(map(str, behind)), self.lag)
            try:
                timings = await self.sync(spec, version, behind) or timings
            except WeightSyncError as err:
                raise FleetError(f"weights version {version} reached no engine of {[str(n) for n in behind]}, and the "
                                 f"rollouts may lag the trainer by {self.lag} version(s) (buffer.max_policy_lag, "
                                 f"buffer.fixed_lag): {err}; see the errors above") from None
        return timings

    async def sync(self, spec: StoreSpec, version: int, only: list[ActorId] | None = None) -> dict[str, float]:
        """Every live engine takes ``version`` while the trainer publishes it: the driver runs this
        and the trainer's ``publish_weights`` together, and the weight store decides how the bytes
        travel (``SyncRound``). An engine that dies meanwhile is synced when it is back; one whose
        sync fails keeps its version (``serving`` does not move), and syncs that keep failing stop
        the run. Returns the largest of each engine's timings (``VLLMPolicy.update_weights``).
        ``only``: these engines (a sync tried again on those it left behind)."""
        self.spec, self.version = spec, version
        live = [name for name in self.membership.engines_up() if only is None or name in only]
        round_ = await SyncRound.open(spec, version, [name.index for name in live], again=only is not None)
        try:
            answers = await asyncio.gather(*(self._update(name, round_) for name in live))
        finally:
            await round_.close()
        loaded = [answer for answer in answers if answer is not None and answer["version"] == version]
        if self._note_serving():
            self.failed_syncs = 0
        else:
            # Rollouts wait for a served version: syncs that keep failing would stall the run.
            self.failed_syncs += 1
            behind = self._behind()
            if self.failed_syncs >= MAX_FAILED_SYNCS:
                raise FleetError(f"weights could not be synced to {[str(n) for n in behind] or 'any engine'} "
                                 f"{self.failed_syncs} times "
                                 f"in a row (last: version {version}); see the errors above")
        timings = [{k: v for k, v in answer.items() if k != "version"} for answer in loaded]
        return {key: max(t[key] for t in timings if key in t) for key in {k for t in timings for k in t}}

    async def _update(self, name: ActorId, round_: SyncRound) -> dict[str, float] | None:
        """``name``'s answer to its update (timings and the version it holds); None when it died
        (it is synced when it is back) or its sync failed (it keeps its previous version)."""
        try:
            answer = await self.membership.calls.call(name, self.membership.members[name].update_weights.remote(
                round_.spec, round_.version), timeout_s=round_.engine_timeout_s, what="update_weights")
        except RemoteCallError as err:
            if not err.died:
                raise
            log.warning("%s; it is synced when it is back", err)
            await round_.engine_died(str(name), str(err))
            self.membership.recover(name)
            return None
        except ray.exceptions.RayTaskError as err:
            if not isinstance(err.cause, WeightSyncError):
                raise
            log.warning("%s", err.cause)
            if isinstance(err.cause, MixedWeights):
                self.held[name] = -1
            return None
        self.held[name] = int(answer["version"])
        return answer

    async def catch_up(self, name: ActorId, held: int) -> None:
        """Bring engine ``name``, back on version ``held`` (restarted, or rejoining after it was
        lost), to the fleet's version: a sync may have passed it by while it was down."""
        self.held[name] = held
        while self.spec is not None and self.held[name] < self.version:
            target = self.version
            try:
                answer = await self.membership.calls.call(name, self.membership.members[name].update_weights.remote(
                    self.spec, target), timeout_s=self.spec.timeout_s + ENGINE_GRACE_S, what="update_weights")
            except ray.exceptions.RayTaskError as err:
                if not isinstance(err.cause, WeightSyncError):
                    raise
                log.warning("%s could not catch up to version %d (the next sync tries again): %s", name, target,
                            err.cause)
                break
            self.held[name] = int(answer["version"])
            if self.held[name] < target:
                # Its games carry the version it holds, so the buffer's lag limit drops them until it catches up.
                log.warning("%s is on version %d until the next sync (version %d cannot reach it now)", name,
                            self.held[name], target)
                break
        self._note_serving()
