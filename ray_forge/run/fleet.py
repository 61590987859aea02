"""The policy engines and env actors as one fleet that keeps playing while its members die.

Ray restarts a dead env actor or engine (``max_restarts``); a restarted engine loads the newest
published weights before it serves (``VLLMPolicy._catch_up``). What the fleet adds on the
driver's side: a batch of games that was in play on a dead actor is replayed from its seeds on a
live pair, so no game is lost and none counts twice (a batch's games exist only once it has
finished); a dead member is waited for, checked for the current weights, and counted; weight
syncs skip a member that is restarting and sync it when it is back.

A member whose node was lost may find no room to restart in: after its role's timeout the run
goes on without it (``lost``) and it rejoins whenever Ray places it again. Only when a role has
no member up for ``cluster.placement_timeout_s`` does the run stop, naming what its pool lacks.

A member that is down is not called but to ask whether it is back: one call each
``REJOIN_CHECK_S``, cancelled when it is not answered in time (Ray queues a call to a restarting
actor until it is placed, for as long as that takes). Calls in flight to it when it went down are
cancelled. An engine whose node is lost takes its process with it: the weight store is told
(``receiver_gone``) as soon as the engine goes down, so no version waits for a read that will
never end. Only a death that is certain is told: a member merely unreachable may still be reading.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import ray

from ray_forge.actors.rollout import RolloutSettings
from ray_forge.cluster import nodes
from ray_forge.config.schema import POOL_LABEL
from ray_forge import identity
from ray_forge.core.episode import Episode
from ray_forge.identity import ActorId, Role
from ray_forge.remote import RemoteCallError, call
from ray_forge.run import sync_check
from ray_forge.weights import MixedWeights, StoreSpec, WeightSyncError
from ray_forge.weights.controller import ControllerClient
from ray_forge.weights.sync import ENGINE_GRACE_S, SyncRound

log = logging.getLogger(__name__)


class FleetError(RuntimeError):
    """No live member of a role is left, or a batch failed on every one."""


MAX_PLAY_ATTEMPTS = 16
"""Times a chunk of games is played again after an actor playing it died, before the run stops."""

MAX_FAILED_SYNCS = 3
"""Consecutive weight syncs that may fail (engines keep their version) before the run stops."""

MAX_EVAL_ATTEMPTS = 3
"""Times an evaluation starts again after its engine or env actor died under it."""

REJOIN_CHECK_S = 10.0
"""How often a member that is down is asked (one call) whether it is back; also how long a member
up has to answer the roll call, and how long a wait for a free member sleeps at most."""

CARRIED = ("actor_restarts", "replayed_games", "chaos_kills", "nodes_lost")
"""Counts since the run began, carried across a resume (``carry``)."""


class Fleet:
    def __init__(self, policies: list, envs: list, *, policy_timeout_s: float, env_timeout_s: float,
                 capacity_timeout_s: float = 300.0, needs: Callable[[Role], str] | None = None,
                 lag: int = 1, steps: int | None = None) -> None:
        self.members: dict[ActorId, object] = (dict(zip(identity.all_of(Role.POLICY, len(policies)), policies))
                                               | dict(zip(identity.all_of(Role.ENV, len(envs)), envs)))
        self.num = {Role.POLICY: len(policies), Role.ENV: len(envs)}
        self.timeout_s = {Role.POLICY: policy_timeout_s, Role.ENV: env_timeout_s}
        self.capacity_timeout_s = capacity_timeout_s
        """How long a role may have no member up before the run stops."""
        self.needs = needs or (lambda role: "their pool lacks room")
        """What one member of a role needs from its pool, in words (the stop's message says it)."""
        self.down_at: dict[ActorId, float] = {}
        """When each member that is down now was found dead."""
        self.pids: dict[ActorId, int] = {}
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
        self.spec: StoreSpec | None = None
        self._recovering: dict[ActorId, asyncio.Task] = {}
        self.closed = False
        self.lost: set[ActorId] = set()
        """Members not back within their role's timeout: the run goes on without them until they are."""
        self.restarts = 0
        self.replayed_games = 0
        self.chaos_kills: list[ActorId] = []
        """Members killed on purpose (``ray_forge/run/chaos.py``)."""
        self.carried: dict[str, int] = {}
        """``CARRIED`` counts from before a resume."""
        self.plays_done = 0
        """Chunks played to the end: the chaos monkey waits for one between its kills."""
        self.nodes_seen: dict[str, str] = {}
        """Every node seen alive since the run began: its id and where it was (address, pool)."""
        self.nodes_lost: set[str] = set()
        self.engine_nodes: dict[ActorId, str] = {}
        """The node each engine's process runs on: when it dies, whether its node went with it."""
        self.calls: dict[ActorId, set[ray.ObjectRef]] = {}
        """The driver's calls in flight to each member: cancelled when it goes down."""
        self.gone: set[tuple[ActorId, int]] = set()
        """Engine processes the weight store was told are dead."""

    async def start(self) -> None:
        """Record each member's process, to tell a restart from a slow answer later, and each
        engine's node."""
        answers = await asyncio.gather(*(self._whoami(name) for name in self.members))
        self.pids = {name: pid for name, (pid, _) in zip(self.members, answers)}
        await asyncio.gather(*(self._note_node(name) for name in self.engines()))

    # -- playing ---------------------------------------------------------------------------
    async def play(self, chunk: int, groups: list[tuple[int, int]], settings: RolloutSettings, key: int,
                   sink: tuple | None = None) -> list[list[Episode]] | dict[str, int]:
        """Play ``groups`` on the chunk's pair: the env actor runs the games against the policy
        engine (``EnvPool.play``) and, with ``sink``, puts them in the buffer itself. If either
        dies the groups are replayed on another pair from their seeds."""
        # A chunk is in play on one env actor for its whole length, so every kill of it or its engine
        # meanwhile costs it an attempt: only a chunk whose actors die this many times in a row
        # (a seed that crashes them, a fleet that cannot stay up) stops the run.
        for attempt in range(MAX_PLAY_ATTEMPTS):
            policy, env = await self._pick(Role.POLICY, chunk + attempt), await self._pick(Role.ENV, chunk + attempt)
            try:
                # A key of its own per attempt: an env actor that was only unreachable may still be
                # playing the first attempt, and two plays must never share an env.
                played = await self._call(env, self.members[env].play.remote(self.members[policy], policy, groups,
                                                                             settings, (key, attempt), sink),
                                          timeout_s=settings.play_limit_s + 60, what="play")
                self.plays_done += 1
                return played
            except RemoteCallError as err:
                if not err.died or err.actor not in self.members:
                    raise
                games = len(groups) * settings.group_size
                self.replayed_games += games
                log.warning("%s; replaying its %d games from their seeds", err, games)
                self.recover(err.actor)
        raise FleetError(f"a batch of {len(groups)} groups failed on {MAX_PLAY_ATTEMPTS} policy/env pairs")

    async def _pick(self, role: Role, start: int) -> ActorId:
        """The first live member of ``role`` from index ``start`` on; waits while all are down, for
        at most ``capacity_timeout_s`` since the last of them went down."""
        while True:
            names = [ActorId(role, (start + k) % self.num[role]) for k in range(self.num[role])]
            live = [n for n in names if not self.down(n)]
            if live:
                return live[0]
            now = time.monotonic()
            waited = now - max(self.down_at.get(n, now) for n in names)
            waiting = [self._recovering[n] for n in names if n in self._recovering]
            if not waiting or waited > self.capacity_timeout_s:
                raise FleetError(f"no {role} actor has been up for {waited:.0f}s (cluster.placement_timeout_s "
                                 f"{self.capacity_timeout_s:.0f}s): Ray could not start {', '.join(map(str, names))} "
                                 f"again; {self.needs(role)}")
            await asyncio.wait(waiting, timeout=min(REJOIN_CHECK_S, self.capacity_timeout_s - waited + 0.1),
                               return_when=asyncio.FIRST_COMPLETED)

    # -- restarts --------------------------------------------------------------------------
    def recover(self, name: ActorId, died: bool = True) -> None:
        """Wait (in the background) for ``name`` to be restarted; one wait per death. Not once the
        fleet is closed: its actors are being shut down, and a wait started then would outlive
        the event loop (Python prints "Task was destroyed but it is pending" after the job's
        last line). The calls in flight to a member that ``died`` are cancelled: queued behind a
        restart that may never come, they would wait for it. One only slow to answer (busy with a
        long play) keeps them: they may still end well."""
        if name not in self._recovering and not self.closed:
            self.down_at[name] = time.monotonic()
            self._recovering[name] = asyncio.create_task(self._recover(name))
            self._recovering[name].add_done_callback(lambda task: self._ended(name, task))
            for ref in self.calls.pop(name, set()) if died else ():
                ray.cancel(ref)

    @staticmethod
    def _ended(name: ActorId, wait: asyncio.Task) -> None:
        """A wait for a member that failed is said, once: no one else awaits it (Python would print
        its traceback at exit as "Task exception was never retrieved")."""
        if not wait.cancelled() and (err := wait.exception()) is not None:
            log.error("waiting for %s to come back failed: %s: %s", name, type(err).__name__, err)

    async def close(self) -> None:
        """At the run's end, before its actors are shut down: waits for restarts are cancelled."""
        self.closed = True
        waits = list(self._recovering.values())
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)

    async def _recover(self, name: ActorId) -> None:
        """Until ``name`` is back and, for an engine, on the fleet's version; an engine that dies
        again while it catches up is waited for again."""
        try:
            await self._forget_if_gone(name)  # now: Ray may declare its node dead only a minute later
            while True:
                pid, version = await self._back(name)
                await self._seen(name, pid)
                if name.role is not Role.POLICY:
                    return
                await self._note_node(name)
                try:
                    await self._sync(name, version)
                    return
                except RemoteCallError as err:
                    if not err.died:  # up but slow: it serves the version it holds until the next sync
                        log.warning("%s; it catches up at the next sync", err)
                        return
                    log.warning("%s while catching up; waiting for it again", err)
        finally:
            self._recovering.pop(name, None)
            self.down_at.pop(name, None)

    async def _back(self, name: ActorId) -> tuple[int, int]:
        """``name``'s (process id, version) once it answers. Past its role's timeout it is lost: the
        run goes on without it until it answers."""
        role = name.role
        deadline = time.monotonic() + self.timeout_s[role]
        while True:
            asked = time.monotonic()
            try:
                answer = await self._whoami(name, timeout_s=min(REJOIN_CHECK_S, self.timeout_s[role]))
                break
            except RemoteCallError as err:
                await self._forget_if_gone(name)
                if time.monotonic() > deadline and name not in self.lost:
                    self.lost.add(name)
                    up = sum(not self.down(n) for n in identity.all_of(role, self.num[role]))
                    log.error("%s is not back after %.0fs (its node lost and no room to place it again, or its "
                              "max_restarts used up): the run goes on with %d of %d %s actors, and it rejoins "
                              "once Ray starts it again (%s)", name, self.timeout_s[role], up, self.num[role],
                              role, err)
                await asyncio.sleep(max(0.0, asked + REJOIN_CHECK_S - time.monotonic()))  # one call per check
        if name in self.lost:
            self.lost.discard(name)
            log.warning("%s is back after %.0fs and rejoins the run", name, time.monotonic() - self.down_at[name])
        return answer

    async def _sync(self, name: ActorId, version: int) -> None:
        """Bring a policy to the fleet's version (a sync may have passed it by while it restarted)."""
        self.held[name] = version
        while self.spec is not None and self.held[name] < self.version:
            target = self.version
            try:
                answer = await self._call(name, self.members[name].update_weights.remote(self.spec, target),
                                          timeout_s=self.spec.timeout_s + ENGINE_GRACE_S, what="update_weights")
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

    async def _seen(self, name: ActorId, pid: int) -> None:
        """``name`` answered from process ``pid``: a new one means Ray restarted it (and an engine's
        old process is dead, for the weight store)."""
        if pid != self.pids.get(name):
            if name in self.pids:
                await self._tell_gone(name, self.pids[name])
            self.restarts += 1
            self.pids[name] = pid
            log.warning("%s restarted (process %d)", name, pid)

    async def _note_node(self, name: ActorId) -> None:
        """Where engine ``name``'s process runs now (asked while it is up)."""
        try:
            self.engine_nodes[name] = await self._call(name, self.members[name].node_id.remote(),
                                                       timeout_s=self.timeout_s[name.role], what="node_id")
        except RemoteCallError as err:  # it went down again: its node is asked when it is back
            log.warning("%s", err)

    async def _forget_if_gone(self, name: ActorId) -> None:
        """An engine that is down, on a node that is lost, is dead: tell the weight store. Asked when
        it goes down (a raylet that refuses connections is gone) and at each rejoin check, as Ray
        may declare the node dead only later."""
        if name.role is Role.POLICY and (name, self.pids.get(name)) not in self.gone and name in self.engine_nodes:
            if await asyncio.to_thread(nodes.lost, self.engine_nodes[name]):
                await self._tell_gone(name, self.pids[name])

    async def _tell_gone(self, name: ActorId, pid: int) -> None:
        """The weight store stops counting engine ``name``'s process ``pid`` as a reader."""
        if name.role is not Role.POLICY or (name, pid) in self.gone or self.spec is None:
            return  # before the first sync nothing was published for it to read
        self.gone.add((name, pid))
        try:
            await ControllerClient(self.spec).receiver_gone(str(name), pid)
        except (RemoteCallError, WeightSyncError) as err:  # the store is gone too (the run is ending)
            log.warning("the weight store was not told that %s (process %d) is dead: %s", name, pid, err)

    async def roll_call(self) -> None:
        """Each member up says which process it is: a new one is a restart the fleet's calls did not
        meet (a member that died idle and was back before its next call). One that is dead, or
        cannot answer in time (waiting for a node to restart on), is recovered: it is left out of
        the games until it answers."""
        async def ask(name: ActorId) -> None:
            try:
                pid, _ = await self._whoami(name, timeout_s=REJOIN_CHECK_S)
            except RemoteCallError as err:
                self.recover(name, died=err.died)
                return
            if not self.down(name):  # an answer from before a death that a call met meanwhile is old news
                await self._seen(name, pid)

        await asyncio.gather(*(ask(name) for name in self.members if not self.down(name)))

    async def _whoami(self, name: ActorId, timeout_s: float | None = None) -> tuple[int, int]:
        return await self._call(name, self.members[name].whoami.remote(), timeout_s=timeout_s or self.timeout_s[name.role],
                                what="whoami")

    async def _call(self, name: ActorId, ref: ray.ObjectRef, *, timeout_s: float, what: str):
        """The answer to a call of the driver's to member ``name``: kept in ``calls`` while in
        flight, and cancelled when it is not answered in time (it would stay queued by Ray
        behind a restart)."""
        self.calls.setdefault(name, set()).add(ref)
        try:
            return await call(ref, timeout_s=timeout_s, what=what, actor=name)
        except RemoteCallError as err:
            if not err.died:
                ray.cancel(ref)
            raise
        finally:
            self.calls.get(name, set()).discard(ref)

    async def settle(self) -> None:
        """Return once no member is restarting, but for those already given up on (``lost``): the
        run's end, where every engine up reports its version."""
        while waits := [task for name, task in self._recovering.items() if name not in self.lost]:
            await asyncio.wait(waits, timeout=1.0)

    def down(self, name: ActorId) -> bool:
        """Whether ``name`` is restarting or gone (it may not hold the fleet's version)."""
        return name in self._recovering or name in self.lost

    def engines_up(self) -> list[ActorId]:
        """The engines up now (not restarting, not lost), policy-0 first."""
        return [name for name in self.engines() if not self.down(name)]

    # -- weights ---------------------------------------------------------------------------
    def engines(self) -> list[ActorId]:
        return identity.all_of(Role.POLICY, self.num[Role.POLICY])

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

    def _behind(self) -> list[ActorId]:
        """The engines up that do not hold the fleet's version."""
        return [name for name in self.engines_up() if self.held.get(name) != self.version]

    async def sync(self, spec: StoreSpec, version: int, only: list[ActorId] | None = None) -> dict[str, float]:
        """Every live engine takes ``version`` while the trainer publishes it: the driver runs this
        and the trainer's ``publish_weights`` together, and the weight store decides how the bytes
        travel (``SyncRound``). An engine that dies meanwhile is synced when it is back; one whose
        sync fails keeps its version (``serving`` does not move), and syncs that keep failing stop
        the run. Returns the largest of each engine's timings (``VLLMPolicy.update_weights``).
        ``only``: these engines (a sync tried again on those it left behind)."""
        self.spec, self.version = spec, version
        names = self.engines()
        live = [i for i, name in enumerate(names) if not self.down(name) and (only is None or name in only)]
        round_ = await SyncRound.open(spec, version, live, again=only is not None)
        try:
            answers = await asyncio.gather(*(self._update(names[i], round_) for i in live))
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

    def _note_serving(self) -> bool:
        """Move ``serving`` to ``version`` once every live engine holds it; whether it is there."""
        live = [name for name in self.engines() if not self.down(name)]
        if live and all(self.held.get(name) == self.version for name in live):
            self.serving = self.version
        return self.serving == self.version

    async def _update(self, name: ActorId, round_: SyncRound) -> dict[str, float] | None:
        """``name``'s answer to its update (timings and the version it holds); None when it died
        (it is synced when it is back) or its sync failed (it keeps its previous version)."""
        try:
            answer = await self._call(name, self.members[name].update_weights.remote(round_.spec, round_.version),
                                      timeout_s=round_.engine_timeout_s, what="update_weights")
        except RemoteCallError as err:
            if not err.died:
                raise
            log.warning("%s; it is synced when it is back", err)
            await round_.engine_died(str(name), str(err))
            self.recover(name)
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

    def stats(self) -> dict[str, int]:
        """Since the run began (``carried`` added): restarts (new processes, met by the fleet's calls
        or its roll call: two of one member between two roll calls count once), games replayed,
        chaos kills and nodes lost. And the members down now: restarting, and lost (not back
        within their timeout)."""
        since_start = dict(actor_restarts=self.restarts, replayed_games=self.replayed_games,
                           chaos_kills=len(self.chaos_kills), nodes_lost=self._count_lost_nodes())
        return {**{k: v + self.carried.get(k, 0) for k, v in since_start.items()},
                "actors_restarting": len(self._recovering.keys() - self.lost), "actors_lost": len(self.lost)}

    def _count_lost_nodes(self) -> int:
        """Nodes of the cluster seen alive since the run began and dead now (a lost pod, a preempted
        VM): each is logged once, with where it was."""
        for node in ray.nodes() if ray.is_initialized() else ():
            node_id = node["NodeID"]
            if node["Alive"]:
                self.nodes_seen.setdefault(node_id, f"{node['NodeManagerAddress']} "
                                                    f"(pool {node.get('Labels', {}).get(POOL_LABEL, 'unlabelled')})")
            elif node_id in self.nodes_seen and node_id not in self.nodes_lost:
                self.nodes_lost.add(node_id)
                log.error("node %s at %s was lost: its actors restart elsewhere or wait for a node to replace it",
                          node_id[:8], self.nodes_seen[node_id])
        return len(self.nodes_lost)

    # -- questions for policy-0 --------------------------------------------------------------
    async def evaluate(self, settings: RolloutSettings, final: bool = False) -> tuple[dict, dict]:
        """The env's greedy evaluation of the first engine up, run by the first env actor up
        (policy-0 and env-0 unless they are down; ``final``: the end-of-run one): its whole result,
        and its metrics-row fields. If either dies, again on the first ones up then."""
        for attempt in range(MAX_EVAL_ATTEMPTS):
            engine, evaluator = await self._pick(Role.POLICY, 0), await self._pick(Role.ENV, 0)
            try:
                return await self._evaluate(engine, evaluator, settings, final)
            except RemoteCallError as err:
                if not err.died or err.actor not in (engine, evaluator) or attempt == MAX_EVAL_ATTEMPTS - 1:
                    raise
                log.warning("%s; evaluating again", err)
                self.recover(err.actor)
        raise AssertionError("unreachable")

    async def _evaluate(self, engine: ActorId, evaluator: ActorId, settings: RolloutSettings,
                        final: bool) -> tuple[dict, dict]:
        # No sync runs during an evaluation (the driver runs both in turn), so this is the version
        # evaluated; a restarted engine may be behind.
        version = await self._version(engine)
        if version != self.version:
            log.warning("%s holds weights version %d, not %d (it missed a sync): evaluating what it holds",
                        engine, version, self.version)
        timeout_s = self.timeout_s[Role.POLICY]
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
            if not up or await self._version(engine) != self.version:
                log.warning("%s is restarting or missed the sync of version %d; the sync check waits for the "
                            "next one", engine, self.version)
                return {}
            asked = sync_check.draw(prompts, count, seed)
            return await sync_check.check(self.members[engine], engine, trainer, asked, seed=seed,
                                          tolerance=tolerance, timeout_s=self.timeout_s[Role.POLICY])
        except RemoteCallError as err:
            if not err.died or err.actor != engine:  # a dead trainer rank stops the run
                raise
            log.warning("%s; the sync check waits for the next one", err)
            self.recover(err.actor)
            return {}

    async def _version(self, name: ActorId) -> int:
        return await self._call(name, self.members[name].get_version.remote(), timeout_s=self.timeout_s[name.role],
                                what="get_version")

