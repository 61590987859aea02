"""The one game loop: rollouts and evaluations play their episodes here, against any policy.

A game alternates model turns and env turns until the env says done or a limit ends it. Two ways
to show the model its game (``EpisodeRules.mode``):

- ``turns``: every observation is a prompt of its own (plain text, no template); each turn
  trains as its own sample. BlackJack's default: its decisions share prompts across games.
- ``sequence``: the episode is one chat, token in, token out (``ray_forge.core.sequence``). The
  env's tools run in the middle of it; the trainer gets one row per segment.

The loop never waits on the slowest game: every game ready for the model goes to the policy in
one call; every game's env turn (a tool call, an env step) runs on its own thread when the env
waits on something (``threads``), or, for cheap envs, all of them in one call off the event loop.
So a slow tool holds only its own game, and a cheap env plays in lockstep, turn by turn, as fast
as one batched call per turn allows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections import Counter
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal, Protocol, Sequence

from ray_forge.config.schema import ToolConfig
from ray_forge.core.chat import CHAT_TOKENS, ChatFormat, Stops, parse_tool_calls
from ray_forge.core.env import TextEnv
from ray_forge.core.episode import Episode, Turn
from ray_forge.core.sequence import SequenceBuilder, TemplateRewrite
from ray_forge.core.tools import ToolRunner, ToolStats


@dataclass(frozen=True)
class EpisodeRules:
    """How a game is shown to the model, and what ends it early."""

    mode: Literal["turns", "sequence"] = "turns"
    max_turns: int = 12
    """Model turns; a game still running after them ends, truncated, with the penalty."""
    turn_tokens: int = 1
    """Tokens the engine may sample in one turn."""
    episode_tokens: int = 128
    """Tokens of the whole sequence (prompt, turns, tool output); never more than the engine's
    ``max_model_len`` either. An episode with no room left ends, truncated."""
    penalty: float = -1.0
    """Reward of a game that was truncated or whose env failed."""
    strict_template: bool = False
    """sequence mode: a chat template that rewrites earlier turns fails the game, naming the turn,
    instead of starting a new segment."""
    tools: ToolConfig = field(default_factory=ToolConfig)


class Policy(Protocol):
    def __call__(self, prompts: list, max_tokens: list[int], stops: Stops, call: int) -> Awaitable[Sequence[Turn]]:
        """One completion per prompt, in order: ``turns`` mode gives observation texts (the engine
        encodes them), ``sequence`` mode token ids, each with its token budget and the ids that
        end a turn (:class:`Stops`). ``call`` counts this play's calls (the source of its sampling seed)."""
        ...


@dataclass
class _Game:
    group_id: int
    seed: int
    env: TextEnv
    turns: list[Turn] = field(default_factory=list)
    prompt: str = ""
    """``turns`` mode: the observation the model answers next."""
    builder: SequenceBuilder | None = None
    reward: float = 0.0
    error: str | None = None
    truncated: str | None = None
    done: bool = False
    tools: ToolStats = field(default_factory=ToolStats)
    void_turns: int = 0

    def next_prompt(self) -> str | tuple[int, ...]:
        return self.builder.prompt() if self.builder is not None else self.prompt

    def end(self, reward: float | None = None, error: str | None = None, truncated: str | None = None) -> None:
        self.done = True
        if reward is not None:
            self.reward = reward
        self.error = error if truncated is None else f"truncated: {truncated}"
        self.truncated = truncated


class Play:
    """One play of ``games`` (group id, seed) against ``policy``; ``run()`` returns their episodes."""

    def __init__(self, games: list[tuple[int, int]], envs: list[TextEnv], policy: Policy, rules: EpisodeRules,
                 *, chat: ChatFormat | None, max_model_len: int, threads: Executor | None,
                 env_timeout_s: float) -> None:
        """``chat``: the model's chat format, for ``sequence`` mode (None in ``turns`` mode)."""
        if (rules.mode == "sequence") != (chat is not None):
            raise ValueError(f"episode mode {rules.mode!r} {'needs' if chat is None else 'takes no'} chat format")
        self.rules, self.policy, self.chat = rules, policy, chat
        self.limit = min(rules.episode_tokens, max_model_len)
        self.env_timeout_s = env_timeout_s
        self.games = [_Game(gid, seed, env) for (gid, seed), env in zip(games, envs, strict=True)]
        self.runner = ToolRunner(rules.tools) if chat is not None else None
        # Games whose env turns call tools go on by themselves, each on its own thread; the others
        # play in lockstep, every turn's env turns together, so each model call holds the same games
        # in the same order (a replay draws the same completions) and shares their prompts.
        self.independent = chat is not None and bool(envs) and bool(envs[0].tools())
        self._own_threads = ThreadPoolExecutor(min(64, len(envs)), thread_name_prefix="turn") \
            if self.independent and threads is None else None
        self.threads = threads or self._own_threads
        self.calls = 0

    async def run(self) -> list[Episode]:
        in_flight: set[asyncio.Task] = set()
        try:
            await self._gather(self._start, self.games)
            ready = [g for g in self.games if not g.done]
            while True:
                ready = self._fit(ready)
                if ready:
                    in_flight.add(asyncio.create_task(self._model_turn(ready)))
                if not in_flight:
                    break
                done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                ready = []
                for task in done:
                    kind, batch = task.result()
                    if kind == "model":
                        in_flight |= self._env_turns(batch)
                    else:
                        ready += [g for g in batch if not g.done]
        except BaseException:
            # Nothing of a failed play may go on using its envs: the caller discards them.
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            raise
        finally:
            if self.runner is not None:
                self.runner.close()
            if self._own_threads is not None:
                self._own_threads.shutdown(wait=False, cancel_futures=True)
        return [self._episode(g) for g in self.games]

    # -- turns ------------------------------------------------------------------------------
    def _fit(self, games: list[_Game]) -> list[_Game]:
        """The games that may take another model turn; the others end, truncated."""
        fit = []
        for game in games:
            if len(game.turns) >= self.rules.max_turns:
                game.end(self.rules.penalty, truncated=f"still playing after {self.rules.max_turns} turns")
            elif game.builder is not None and self.limit - len(game.builder) < 1:
                game.end(self.rules.penalty, truncated=f"no room left in {self.limit} tokens")
            else:
                fit.append(game)
        return fit

    async def _model_turn(self, games: list[_Game]) -> tuple[str, list[_Game]]:
        call, self.calls = self.calls, self.calls + 1
        prompts = [g.next_prompt() for g in games]
        budgets = [min(self.rules.turn_tokens, self.limit - len(p)) if g.builder is not None else self.rules.turn_tokens
                   for g, p in zip(games, prompts)]
        stops = self.chat.stops if self.chat is not None else Stops()
        completions = await self.policy(prompts, budgets, stops, call)
        for game, turn in zip(games, completions, strict=True):
            game.turns.append(turn)
        return "model", games

    def _env_turns(self, games: list[_Game]) -> set[asyncio.Task]:
        if not self.independent:
            return {asyncio.create_task(self._gather(self._env_turns_of, games))}
        return {asyncio.create_task(self._gather(self._env_turns_of, [g])) for g in games}

    async def _gather(self, fn: Callable[[list[_Game]], None], games: list[_Game]) -> tuple[str, list[_Game]]:
        """``fn`` of the games off the event loop: on the env's threads, one game each, or of all
        of them in one call for a cheap env. Under the run's env timeout."""
        if self.threads is None:
            work = asyncio.to_thread(fn, games)
        else:
            work = asyncio.gather(*(asyncio.wrap_future(self.threads.submit(fn, [g])) for g in games))
        try:
            await asyncio.wait_for(work, self.env_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"an env turn of {len(games)} games did not finish within env.call_timeout_s="
                               f"{self.env_timeout_s:.0f}s") from None
        return "env", games

    # -- on a thread: the env's side of a game --------------------------------------------
    def _start(self, games: list[_Game]) -> None:
        """Deal the games, all in one ``reset_all`` (an env may deal a batch at once)."""
        reset_all = getattr(type(games[0].env), "reset_all", TextEnv.reset_all) if games else TextEnv.reset_all
        for game, observation in zip(games, reset_all([g.env for g in games], [g.seed for g in games]), strict=True):
            try:
                if isinstance(observation, Exception):
                    raise observation
                if self.chat is None:
                    game.prompt = observation
                else:
                    game.builder = SequenceBuilder(self.chat, [_user(observation)], self.rules.strict_template)
            except Exception as err:  # one game's failure must not end the batch
                game.end(self.rules.penalty, f"env reset error: {err}")

    def _env_turns_of(self, games: list[_Game]) -> None:
        for game in games:
            self._env_turn(game)

    def _env_turn(self, game: _Game) -> None:
        try:
            self._answer(game)
        except TemplateRewrite:
            raise  # strict template mode: the run stops, naming the turn
        except Exception as err:  # one game's failure must not end the batch
            game.end(self.rules.penalty, f"env error: {type(err).__name__}: {err}")

    def _answer(self, game: _Game) -> None:
        turn = game.turns[-1]
        if game.builder is None:
            self._step(game, turn.text)
            return
        text = self.chat.decode(turn.response_ids)
        room = self.limit - len(game.builder)
        game.builder.add_model_turn(turn, text)
        if len(turn.response_ids) >= room and not self.chat.stopped(turn.response_ids):
            # Cut off by the room left, not by the turn's own budget: no answer to judge.
            game.end(self.rules.penalty, truncated=f"no room left in {self.limit} tokens")
            return
        tools = {tool.name: tool for tool in game.env.tools()}
        calls = parse_tool_calls(text) if tools else []
        if calls:
            replies = self.runner.run(tools, calls, game.tools)
            if replies is None:
                game.end(self.rules.penalty, truncated=f"more than {self.rules.tools.max_calls} tool calls")
            else:
                game.builder.add_env_turn([dict(m, content=escape(m["content"])) for m in replies])
            return
        if not text.strip():
            game.void_turns += 1
        self._step(game, text)

    def _step(self, game: _Game, text: str) -> None:
        result = game.env.step(text)
        game.reward += result.reward
        if result.done:
            game.end(error=result.info.get("error"))
        elif game.builder is None:
            game.prompt = result.observation
        else:
            game.builder.add_env_turn([_user(result.observation)])

    # -- results ----------------------------------------------------------------------------
    def _episode(self, game: _Game) -> Episode:
        stats = dict(tool_calls=float(game.tools.calls), void_turns=float(game.void_turns),
                     **{f"tool_error_{k}": float(v) for k, v in game.tools.errors.items()})
        segments, messages, turns = (), (), tuple(game.turns)
        if game.builder is not None:
            segments, messages = game.builder.segments(), tuple(game.builder.messages)
            # Each turn's prompt is the whole prefix, already in the segment: not kept twice.
            turns = tuple(dataclasses.replace(t, prompt_ids=()) for t in turns)
            stats["segments"] = float(game.builder.num_segments)
        if game.truncated is not None:
            stats["truncated"] = 1.0
        return Episode(group_id=game.group_id, seed=game.seed, turns=turns, reward=game.reward,
                       error=game.error, segments=segments, stats=stats,
                       tool_latencies_s=tuple(game.tools.latencies_s), messages=messages)


def _user(text: str) -> dict:
    return {"role": "user", "content": escape(text)}


def escape(content: str) -> str:
    """Env and tool text with the chat format's control tokens broken up: a program that prints
    ``<|im_end|>`` must not end its own turn or forge the model's."""
    for token in CHAT_TOKENS:
        content = content.replace(token, token[0] + "\u200b" + token[1:])
    return content


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """What a batch of episodes says about tools and lengths: per-episode means, error counts,
    latency percentiles, truncations by reason."""
    if not episodes:
        return {}
    n = len(episodes)
    totals = Counter()
    for episode in episodes:
        totals.update(episode.stats)
    latencies = sorted(s for e in episodes for s in e.tool_latencies_s)
    tokens = [sum(len(s.token_ids) for s in e.training_segments()) for e in episodes]
    metrics = dict(tool_calls_per_episode=totals["tool_calls"] / n,
                   tool_errors=float(sum(v for k, v in totals.items() if k.startswith("tool_error_"))),
                   void_turns=totals["void_turns"], tokens_per_episode=sum(tokens) / n,
                   segments_per_episode=totals["segments"] / n if "segments" in totals else 1.0,
                   turns_per_episode=sum(len(e.turns) for e in episodes) / n)
    metrics.update({k: float(v) for k, v in totals.items() if k.startswith("tool_error_")})
    if latencies:
        metrics.update(tool_latency_p50_s=statistics.median(latencies),
                       tool_latency_p95_s=latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))])
    reasons = Counter(_reason(e.error) for e in episodes if e.error and e.error.startswith("truncated: "))
    metrics.update({f"truncated_{reason}": float(count) for reason, count in reasons.items()})
    return metrics


def _reason(error: str) -> str:
    """A truncation's reason as a metric name: the limit that ended it."""
    text = error.removeprefix("truncated: ")
    return "max_turns" if "turns" in text else "tool_calls" if "tool calls" in text else "tokens"
