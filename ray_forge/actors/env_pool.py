"""Env pool actor and the rollout worker beside it: plays many games at once on a CPU-pool node.

``play`` runs the whole game loop here, next to the envs: observations go to a policy engine as
prompts, its completions come back as actions, and finished groups go straight into the replay
buffer. The driver hands out seeds and gets counts back; no token passes through it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor

import ray

from ray_forge.actors.rollout import RolloutSettings, request_seed
from ray_forge.config.schema import EnvConfig
from ray_forge.core.chat import ChatFormat, Stops
from ray_forge.core.env import EnvSetup, StepResult, TextEnv
from ray_forge.core.episode import Episode
from ray_forge.identity import ActorId
from ray_forge.core.play import Play
from ray_forge.remote import SMALL_CALL_S, ActorRestarted, Pickled, RemoteCallError, call, get

log = logging.getLogger(__name__)


EVAL_CHUNK = 64
"""Games an evaluation plays at once."""
TURN_THREADS = 64
"""Env turns in flight at once on an env actor whose games call tools."""


class EnvPool:
    """Many concurrent games, grouped in batches by a caller-chosen key.

    ``reset(key, seeds)`` deals a batch (a game whose reset raises starts over, with the penalty); ``step(key, slots, actions)`` advances chosen games of
    it; ``release(key)`` returns its envs for reuse. Batches with different keys never share
    an env, so several rollouts can use one pool at once. An env that raises does not take
    the pool down: that game ends with the penalty and the error is reported in ``info``.
    """

    def __init__(self, config: EnvConfig, env: EnvSetup, tokenizer=None) -> None:
        """``env``: the job's env (``envs/registry.py``); its spec's factory runs here, once.
        ``tokenizer``: the model's, for ``sequence`` episodes (its chat template renders them)."""
        self._env, self._penalty = env, config.invalid_action_penalty
        self._make = env.make_env(self._penalty)
        self._batches: dict[int, list[TextEnv]] = {}
        self._free: list[TextEnv] = []
        first = self._make()
        self.action_words = first.action_words
        self._free.append(first)
        self._chat, tools = None, first.tools()
        if tools and config.episode.mode != "sequence":
            raise ValueError(f"env {env.spec.name!r} offers tools ({[t.name for t in tools]}): they are called "
                             "mid-episode, so set env.episode.mode=sequence")
        if config.episode.mode == "sequence":
            if tokenizer is None:
                raise ValueError("env.episode.mode=sequence needs the model's tokenizer (its chat template)")
            self._chat = ChatFormat(tokenizer, [tool.schema for tool in tools])
        concurrency = env.concurrency()
        # An env that waits (a sandbox, a server) steps ``concurrency`` games at once; one whose
        # games call tools mid-episode gives every game in flight a thread of its own, so a slow
        # tool holds only its game (its sandbox still admits ``concurrency`` executions at once).
        threads = max(TURN_THREADS, concurrency) if tools else concurrency
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="env-turn") if threads > 1 else None
        self._lock = threading.RLock()

    def _map(self, fn, *iterables) -> list:
        return list(self._threads.map(fn, *iterables)) if self._threads else list(map(fn, *iterables))

    def reset(self, key: Hashable, seeds: list[int]) -> list[StepResult]:
        """Deal one game per seed. Each result carries the first observation; a game whose reset
        raised is already over (``done``, the penalty, and the reason in ``info['error']``)."""
        with self._lock:  # plays of several chunks deal from their own threads
            self.release(key)
            envs = [self._free.pop() if self._free else self._make() for _ in seeds]
            self._batches[key] = envs

        def one(env: TextEnv, seed: int) -> StepResult:
            try:
                return StepResult(env.reset(seed), 0.0, False, {})
            except Exception as err:  # one game's failure must not end the batch
                log.warning("env %s reset(%d) failed: %s", key, seed, err)
                return StepResult("", self._penalty, True, {"error": f"env reset error: {err}"})

        return self._map(one, envs, seeds)

    def step(self, key: Hashable, slots: list[int], actions: list[str]) -> list[StepResult]:
        if key not in self._batches:
            raise ActorRestarted(f"batch {key} is not dealt here: this env actor was restarted since")
        envs = self._batches[key]

        def one(slot: int, action: str) -> StepResult:
            try:
                return envs[slot].step(action)
            except Exception as err:  # a broken game must not kill the other games
                log.warning("env %s slot %d failed on %r: %s", key, slot, action[:80], err)
                return StepResult("", self._penalty, True, {"error": f"env error: {err}"})

        if len(slots) != len(actions):
            raise ValueError(f"{len(slots)} slots but {len(actions)} actions")
        return self._map(one, slots, actions)

    def release(self, key: Hashable) -> None:
        with self._lock:
            self._free.extend(self._batches.pop(key, []))

    async def play(self, policy, policy_id: ActorId, groups: list[tuple[int, int]], settings: RolloutSettings,
                   key: Hashable, sink: tuple | None = None) -> list[list[Episode]] | dict[str, int]:
        """Play ``groups`` on this pool's envs against ``policy`` (an engine actor), with the game
        loop of ``ray_forge.core.play``.

        With ``sink = (buffer, batch, chunk, num_chunks)`` the groups go into the buffer as that
        chunk of that batch, and only counts come back (``games``, ``tokens``); without, the
        groups come back (evaluation). A policy that dies raises RemoteCallError naming it, so
        the driver can replay the chunk elsewhere; a policy or env call that times out raises one
        too (not a death: the run stops, naming the call)."""
        games = [(gid, seed) for gid, seed in groups for _ in range(settings.group_size)]
        episodes = await self._play(games, self._engine(policy, policy_id, settings, groups), settings, key)
        g = settings.group_size
        played = [episodes[i:i + g] for i in range(0, len(episodes), g)]
        if sink is None:
            return played
        buffer, batch, chunk, num_chunks = sink
        await call(buffer.add_chunk.remote(batch, chunk, num_chunks, Pickled(played)), timeout_s=SMALL_CALL_S,
                   what="buffer.add_chunk")
        return dict(games=len(episodes), tokens=sum(len(t.response_ids) for e in episodes for t in e.turns))

    async def _play(self, games: list[tuple[int, int]], engine, settings: RolloutSettings, key: Hashable) -> list[Episode]:
        with self._lock:  # plays of several chunks deal from their own threads
            self.release(key)
            envs = [self._free.pop() if self._free else self._make() for _ in games]
            self._batches[key] = envs
        try:
            episodes = await Play(games, envs, engine, settings.episode_rules(), chat=self._chat,
                                  max_model_len=settings.max_model_len, threads=self._threads,
                                  env_timeout_s=settings.env_timeout_s).run()
        except BaseException as err:
            # The batch is replayed elsewhere; a thread of this play may still hold one of its envs
            # (a tool call, a judge), so none of them is dealt again.
            with self._lock:
                self._batches.pop(key, None)
            if isinstance(err, TimeoutError):  # an env turn that hangs: not a death, the run stops naming it
                raise RemoteCallError(f"{self._name()}.step: {err}", f"{self._name()}.step") from None
            raise
        self.release(key)
        return episodes

    def _engine(self, policy, policy_id: ActorId, settings: RolloutSettings, groups: list[tuple[int, int]]):
        """The game loop's policy: calls of ``policy`` (an engine actor) under the rollout's timeout,
        text prompts in ``turns`` mode, token ids in ``sequence`` mode."""
        async def generate(prompts: list, max_tokens: list[int], stops: Stops, call_index: int):
            seed = None if settings.greedy else request_seed(groups, call_index)
            ref = (policy.generate_ids.remote(prompts, max_tokens, stops, settings.greedy, seed, settings.priority)
                   if self._chat is not None else policy.generate.remote(prompts, settings.greedy, seed, settings.priority))
            return await call(ref, timeout_s=settings.policy_timeout_s, what="generate", actor=policy_id)

        return generate

    def _name(self) -> str:
        return ray.get_runtime_context().get_actor_name() or "env"

    async def evaluate(self, policy, policy_id: ActorId, final: bool, timeout_s: float,
                       settings: RolloutSettings) -> tuple[dict[str, float], dict]:
        """The env's own greedy evaluation of ``policy`` (its metrics and whole result), run here
        beside the envs (a sandbox, a server's sessions) in a thread, so plays go on meanwhile.
        Its games (``play``) are played by the same loop as the rollouts', greedily, ahead of them."""
        loop = asyncio.get_running_loop()
        greedy = dataclasses.replace(settings, greedy=True, priority=-1, group_size=1)

        def decide(prompts: list[str]) -> list[str]:
            # Ahead of the rollouts' requests: the training loop waits for this evaluation. In a
            # sequence run each prompt is the first turn of a chat, as the model was trained on it.
            if self._chat is None:
                ref = policy.generate.remote(prompts, True, None, -1)
            else:
                ids = [tuple(self._chat.render([{"role": "user", "content": p}], True)) for p in prompts]
                ref = policy.generate_ids.remote(ids, [greedy.rules.turn_tokens] * len(ids), self._chat.stops, True,
                                                 None, -1)
            turns = get(ref, timeout_s=timeout_s, what="generate", actor=policy_id)
            return [turn.text if self._chat is None else self._chat.decode(turn.response_ids) for turn in turns]

        def play(seeds: list[int], greedy: bool = True) -> list[Episode]:
            # In chunks: each env turn has the env timeout, and a chunk's turns all wait on one sandbox.
            how = dataclasses.replace(settings, greedy=greedy, priority=-1, group_size=1)
            episodes = []
            for first in range(0, len(seeds), EVAL_CHUNK):
                games = [(first + i, seed) for i, seed in enumerate(seeds[first:first + EVAL_CHUNK])]
                engine = self._engine(policy, policy_id, how, games)
                work = self._play(games, engine, how, ("eval", id(seeds), greedy, first))
                episodes += asyncio.run_coroutine_threadsafe(work, loop).result(timeout=how.play_limit_s)
            return episodes

        return await asyncio.to_thread(self._env.evaluate, decide, self._make, play=play,
                                       invalid_action_penalty=self._penalty, final=final)

    def close(self) -> None:
        """Frees what envs hold outside this process (an OpenEnv server's sessions)."""
        for key in list(self._batches):
            self.release(key)
        for env in self._free:
            env.close()
        self._free.clear()
        self._make.close()

    def get_action_words(self) -> tuple[str, ...] | None:
        return self.action_words

    def whoami(self) -> tuple[int, int]:
        """(process id, 0): a new process id means Ray restarted this actor."""
        return os.getpid(), 0

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


EnvPoolActor = ray.remote(EnvPool)

