"""The policy engines and env actors as one fleet that keeps playing while its members die.

Ray restarts a dead env actor or engine (``max_restarts``); a restarted engine loads the newest
published weights before it serves (``VLLMPolicy._catch_up``). What the fleet adds on the
driver's side: a batch of games that was in play on a dead actor is replayed from its seeds on a
live pair, so no game is lost and none counts twice (a batch's games exist only once it has
finished); a dead member is waited for, checked for the current weights, and counted; weight
syncs skip a member that is restarting and sync it when it is back.

Its parts: ``membership`` (who is up, restarts, lost members, the driver's calls), ``versions``
(which weights each engine holds, syncs, catch-up) and ``counters`` (what a resume carries on).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from operator import attrgetter

import ray

from ray_forge import identity
from ray_forge.actors.launch import Actors
from ray_forge.actors.rollout import RolloutSettings
from ray_forge.config.schema import JobConfig
from ray_forge.core.episode import Episode
from ray_forge.identity import ActorId, Role
from ray_forge.remote import REPLY_SLACK_S, RemoteCallError
from ray_forge.run import sync_check
from ray_forge.run.fleet.counters import CARRIED, Counters
from ray_forge.run.fleet.membership import REJOIN_CHECK_S, FleetError, Membership
from ray_forge.run.fleet.pairs import Pairs
from ray_forge.run.fleet.versions import MAX_FAILED_SYNCS, Versions

__all__ = ["CARRIED", "MAX_FAILED_SYNCS", "REJOIN_CHECK_S", "Fleet", "FleetError"]

log = logging.getLogger(__name__)

MAX_PLAY_ATTEMPTS = 16
"""Times a chunk of games is played again after an actor playing it died, before the run stops."""

MAX_EVAL_ATTEMPTS = 3
"""Times an evaluation starts again after its engine or env actor died under it."""

KILL_SETTLE_S = 1.0
"""How long a killed member's process takes to go: the fleet then waits for the new one."""


def _of(path: str) -> property:
    """The fleet's read-only view of what ``path`` names in its parts (``"versions.serving"``)."""
    return property(attrgetter(path))


class Fleet:
    def __init__(self, policies: list, envs: list, *, policy_timeout_s: float, env_timeout_s: float,
                 capacity_timeout_s: float = 300.0, needs: Callable[[Role], str] | None = None,
                 lag: int = 1, steps: int | None = None) -> None:
        members = (dict(zip(identity.all_of(Role.POLICY, len(policies)), policies))
                   | dict(zip(identity.all_of(Role.ENV, len(envs)), envs)))
        self.counters = Counters()
        self.membership = Membership(members, self.counters,
                                     timeout_s={Role.POLICY: policy_timeout_s, Role.ENV: env_timeout_s},
                                     catch_up=lambda name, held: self.versions.catch_up(name, held),
                                     store=lambda: self.versions.spec)
        self.versions = Versions(self.membership, lag=lag, steps=steps)
        self.pairs = Pairs(self.membership, capacity_timeout_s=capacity_timeout_s,
                           needs=needs or (lambda role: "their pool lacks room"))

    @classmethod
    def of(cls, config: JobConfig, actors: Actors) -> Fleet:
        """The fleet of a run's engines and env actors, with its config's bounds."""
        return cls(actors.policies, actors.envs, policy_timeout_s=config.policy.call_timeout_s,
                   env_timeout_s=config.env.call_timeout_s, capacity_timeout_s=config.cluster.capacity_timeout_s,
                   needs=lambda role: actors.pools.need(role.value, config.cluster.pool_labels),
                   lag=0 if config.buffer.fixed_lag else config.buffer.max_policy_lag, steps=config.run.steps)

    # The parts' state and methods, asked of the fleet.
    members, lost, pids, engine_nodes, calls, _call = (_of(f"membership.{name}") for name in (
        "members", "lost", "pids", "engine_nodes.of", "calls.in_flight", "calls.call"))
    start, down, engines_up, recover, roll_call, settle, close = (_of(f"membership.{name}") for name in (
        "start", "down", "engines_up", "recover", "roll_call", "settle", "close"))
    version, held, serving, failed_syncs, spec, sync_weights, sync, until_serving = (
        _of(f"versions.{name}") for name in ("version", "held", "serving", "failed_syncs", "spec", "sync_weights",
                                             "sync", "until_serving"))
    _pick, plays_done = _of("pairs.pick"), _of("counters.plays_done")

    async def play(self, chunk: int, groups: list[tuple[int, int]], settings: RolloutSettings, key: int,
                   sink: tuple | None = None) -> list[list[Episode]] | dict[str, int]:
        """Play ``groups`` on the chunk's pair: the env actor runs the games against the policy
        engine (``EnvPool.play``) and, with ``sink``, puts them in the buffer itself. If either
        dies the groups are replayed on another pair from their seeds."""
        games = len(groups) * settings.group_size

        async def attempt(policy: ActorId, env: ActorId, attempt: int):
            # A key of its own per attempt: an env actor that was only unreachable may still be
            # playing the first attempt, and two plays must never share an env.
            return await self._call(env, self.members[env].play.remote(self.members[policy], policy, groups,
                                                                        settings, (key, attempt), sink),
                                    timeout_s=settings.play_limit_s + REPLY_SLACK_S, what="play")

        def replay(err: RemoteCallError) -> None:
            self.counters.replayed(games)
            log.warning("%s; replaying its %d games from their seeds", err, games)

        # A chunk is in play on one env actor for its whole length, so every kill of it or its engine
        # meanwhile costs it an attempt: only a chunk whose actors die this many times in a row
        # (a seed that crashes them, a fleet that cannot stay up) stops the run.
        played = await self.pairs.on_live(
            attempt, at=lambda attempt: chunk + attempt, attempts=MAX_PLAY_ATTEMPTS, died=replay,
            gave_up=f"a batch of {len(groups)} groups failed on {MAX_PLAY_ATTEMPTS} policy/env pairs")
        self.counters.played()
        return played

    async def kill(self, name: ActorId) -> None:
        """Kill ``name`` on purpose (``ray_forge/run/chaos.py``) as a crash would: Ray restarts it,
        and the fleet counts the kill and waits for the new process."""
        ray.kill(self.members[name], no_restart=False)
        self.counters.killed(name)
        await asyncio.sleep(KILL_SETTLE_S)
        self.recover(name)

    def stats(self) -> dict[str, int]:
        """Since the run began (counts from before a resume added): restarts (new processes, met by
        the fleet's calls or its roll call: two of one member between two roll calls count once),
        games replayed, chaos kills and nodes lost. And the members down now: restarting, and lost
        (not back within their timeout)."""
        return {**self.counters.state_dict(), **self.membership.down_now()}

    # -- questions for policy-0 --------------------------------------------------------------
    async def evaluate(self, settings: RolloutSettings, final: bool = False) -> tuple[dict, dict]:
        """The env's greedy evaluation of the first engine up, run by the first env actor up
        (policy-0 and env-0 unless they are down; ``final``: the end-of-run one): its whole result,
        and its metrics-row fields. If either dies, again on the first ones up then."""
        return await self.pairs.on_live(
            lambda engine, evaluator, _: self._evaluate(engine, evaluator, settings, final), at=lambda _: 0,
            attempts=MAX_EVAL_ATTEMPTS, died=lambda err: log.warning("%s; evaluating again", err))

    async def _evaluate(self, engine: ActorId, evaluator: ActorId, settings: RolloutSettings,
                        final: bool) -> tuple[dict, dict]:
        # No sync runs during an evaluation (the driver runs both in turn), so this is the version
        # evaluated; a restarted engine may be behind.
        version = await self.versions.held_by(engine)
        if version != self.version:
            log.warning("%s holds weights version %d, not %d (it missed a sync): evaluating what it holds",
                        engine, version, self.version)
        timeout_s = self.membership.timeout_s[Role.POLICY]
        metrics, result = await self._call(evaluator, self.members[evaluator].evaluate.remote(
            self.members[engine], engine, final, timeout_s, settings), timeout_s=settings.play_limit_s, what="evaluate")
        row = {f"eval_{name}": value for name, value in metrics.items()}
        return dict(result, policy_version=version), dict(row, eval_policy_version=version)

    async def check_sync(self, trainer, prompts: list[str], *, seed: int, tolerance: float, count: int = 0) -> dict:
        """The first engine up (policy-0 unless it is down) against ``trainer`` on ``count`` of
        ``prompts`` (``sync_check.draw``) right after a sync (``sync_check.check``); nothing (and a
        warning) when it missed the sync, or no engine is up: the next check compares again."""
        up = self.engines_up()
        engine = up[0] if up else identity.policy(0)
        try:
            if not up or await self.versions.held_by(engine) != self.version:
                log.warning("%s is restarting or missed the sync of version %d; the sync check waits for the "
                            "next one", engine, self.version)
                return {}
            asked = sync_check.draw(prompts, count, seed)
            return await sync_check.check(self.members[engine], engine, trainer, asked, seed=seed,
                                          tolerance=tolerance, timeout_s=self.membership.timeout_s[Role.POLICY])
        except RemoteCallError as err:
            if not err.died or err.actor != engine:  # a dead trainer rank stops the run
                raise
            log.warning("%s; the sync check waits for the next one", err)
            self.recover(err.actor)
            return {}
