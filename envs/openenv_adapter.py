"""Any OpenEnv environment server, driven as a ray_forge ``TextEnv``.

Each env holds one WebSocket session through OpenEnv's own ``GenericEnvClient``: in recent
OpenEnv, HTTP ``/reset`` and ``/step`` build a fresh env per request, so an episode of several
steps needs the socket. A codec turns the server's observations into prompts and the model's
text into the server's actions:

- ``text``: a ray_forge env served by ``envs/openenv_server.py`` (observations carry the prompt);
- ``openspiel_blackjack``: OpenEnv's OpenSpiel BlackJack (``OpenSpielAction``/``OpenSpielObservation``),
  whose prompt is rebuilt from the observation tensor so the model sees its cards and the dealer's.

``reset(seed)`` passes the seed on. OpenEnv's own OpenSpiel server ignores it, so GRPO groups
played against it compare different deals (noisier advantages, same expectation).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Literal, Protocol

from envs.blackjack import ACTION_WORDS, State, parse_action, render_state
from envs.blackjack.env import outcome_text
from ray_forge.core.env import EnvMaker, EnvSpec, StepResult, TextEnv
from ray_forge.core.tools import ToolError


class OpenEnvError(RuntimeError):
    """The server could not be reached, answered with an error, or timed out."""


class Codec(Protocol):
    action_words: tuple[str, ...] | None

    def prompt(self, observation: dict) -> str: ...

    def action(self, text: str, observation: dict) -> dict | None:
        """The server's action for the model's text; None when the text is not a legal action."""
        ...

    def final_text(self, observation: dict, reward: float) -> str: ...


class TextCodec:
    """Observations and actions are text already (``TextObservation``/``TextAction``)."""

    action_words = None  # the server says, in each observation

    def prompt(self, observation: dict) -> str:
        return observation["text"]

    def action(self, text: str, observation: dict) -> dict | None:
        return {"text": text}

    def final_text(self, observation: dict, reward: float) -> str:
        return observation["text"]


# OpenSpiel's blackjack observation tensor (OpenEnv sends it as ``info_state``: the game has no
# information-state tensor). [0:33) turn flags and a thermometer of the player's total,
# [33:85) the dealer's face-up cards, [85:137) the player's cards, [137:189) every card the
# player has seen. A card block is one-hot over 52 cards, suit-major, ranks A, 2, ..., K.
# tests/test_openenv.py checks this decoding against pyspiel's own states.
_TENSOR_SIZE = 189
_DEALER_UP = slice(33, 85)
_PLAYER = slice(85, 137)
_HIT, _STAND = 0, 1


def _card_values(block: list[float]) -> list[int]:
    return [min(i % 13 + 1, 10) for i, bit in enumerate(block) if bit]


def blackjack_state(info_state: list[float]) -> State:
    """The player's total, the dealer's face-up card and whether an ace counts 11."""
    if len(info_state) != _TENSOR_SIZE:
        raise OpenEnvError(f"not an OpenSpiel blackjack observation: info_state has {len(info_state)} "
                           f"values, expected {_TENSOR_SIZE} (is the server's OPENSPIEL_GAME blackjack?)")
    player, dealer = _card_values(info_state[_PLAYER]), _card_values(info_state[_DEALER_UP])
    if not player or len(dealer) != 1:
        raise OpenEnvError(f"blackjack observation without the player's cards or one dealer card "
                           f"(player {player}, dealer {dealer})")
    total = sum(player)
    soft = 1 in player and total + 10 <= 21
    return State(total + 10 if soft else total, dealer[0], soft)


class OpenSpielBlackjackCodec:
    """The same prompts and action words as ``envs.blackjack``, so one model plays both."""

    action_words = ACTION_WORDS

    def prompt(self, observation: dict) -> str:
        return render_state(blackjack_state(observation["info_state"]))

    def action(self, text: str, observation: dict) -> dict | None:
        choice = parse_action(text)  # gymnasium's encoding: 1 hit, 0 stick
        if choice is None:
            return None
        action_id = _HIT if choice == 1 else _STAND
        legal = observation.get("legal_actions")
        return {"action_id": action_id} if not legal or action_id in legal else None

    def final_text(self, observation: dict, reward: float) -> str:
        return outcome_text(reward)


CODECS: dict[str, Callable[[], Codec]] = {"text": TextCodec, "openspiel_blackjack": OpenSpielBlackjackCodec}


class _SessionLoop:
    """One event loop thread per process carries every env's socket (OpenEnv's sync wrapper
    would start a thread per session)."""

    _loop: asyncio.AbstractEventLoop | None = None
    _lock = threading.Lock()

    @classmethod
    def run(cls, coro: Coroutine, timeout_s: float) -> Any:
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="openenv-sessions", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, cls._loop).result(timeout_s)


class OpenEnvTextEnv(TextEnv):
    """One OpenEnv session, reused across episodes (the server resets it in place)."""

    def __init__(self, options: OpenEnvOptions, invalid_action_penalty: float) -> None:
        from openenv.core import GenericEnvClient

        self.url, self.codec, self.penalty = options.url, CODECS[options.codec](), invalid_action_penalty
        self._client = GenericEnvClient(base_url=options.url, connect_timeout_s=options.connect_timeout_s,
                                        message_timeout_s=options.message_timeout_s)
        # The client enforces both timeouts; this bound only catches a wedged event loop.
        self._timeout_s = options.connect_timeout_s + options.message_timeout_s + 5.0
        self._observation: dict | None = None
        self._action_words = self.codec.action_words
        self._tools: list[dict] | None = None

    @property
    def action_words(self) -> tuple[str, ...] | None:
        if self._action_words is None and isinstance(self.codec, TextCodec):
            self.reset(0)  # a text server states its action words in every observation
        return self._action_words

    def reset(self, seed: int) -> str:
        result = self._call(self._client.reset(seed=seed), "reset")
        self._observation = result.observation
        if isinstance(self.codec, TextCodec) and result.observation.get("action_words"):
            self._action_words = tuple(result.observation["action_words"])
        self._tools = result.observation.get("tools") or []
        return self.codec.prompt(result.observation)

    def tools(self) -> list:
        """The served episode's tools, each a call over this game's session."""
        if not isinstance(self.codec, TextCodec):
            return []
        if self._tools is None:
            self.reset(0)  # a text server lists its tools in every observation
        return [RemoteTool(self, schema) for schema in self._tools]

    def step(self, action_text: str) -> StepResult:
        if self._observation is None:
            raise RuntimeError("step() before reset()")
        action = self.codec.action(action_text, self._observation)
        if action is None:
            self._observation = None  # the server's episode is abandoned; the next reset starts over
            return StepResult(outcome_text(self.penalty), self.penalty, True, {"error": "invalid action"})
        result = self._call(self._client.step(action), "step")
        reward = float(result.reward or 0.0)
        observation = result.observation
        self._observation = None if result.done else observation
        text = self.codec.final_text(observation, reward) if result.done else self.codec.prompt(observation)
        info = dict(observation.get("info") or {})
        if observation.get("error"):
            info["error"] = observation["error"]
        return StepResult(text, reward, bool(result.done), info)

    def close(self) -> None:
        try:
            _SessionLoop.run(self._client.disconnect(), 5.0)
        except Exception:  # a dead or wedged connection: forget it
            self._client._ws = None

    def _call(self, coro: Coroutine, what: str) -> Any:
        try:
            return _SessionLoop.run(coro, self._timeout_s)
        except Exception as err:
            # The socket may be half-used now: close it, so the next reset reconnects cleanly.
            self._observation = None
            self.close()
            reason = "timed out" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}"
            if "CAPACITY_REACHED" in reason:
                reason += (" (each game in flight holds a session: start the server with more sessions, or "
                           "play fewer games at once)")
            raise OpenEnvError(f"OpenEnv server {self.url}: {what} failed: {reason}") from err


class RemoteTool:
    """One tool of a served episode: a call is a step that names it, and the episode goes on."""

    def __init__(self, env: OpenEnvTextEnv, schema: dict) -> None:
        self.env, self.schema, self.name = env, schema, schema["function"]["name"]

    def __call__(self, arguments: dict) -> str:
        result = self.env._call(self.env._client.step({"tool": self.name, "arguments": arguments}), "tool call")
        observation = result.observation
        if observation.get("info", {}).get("tool_error") == "raised":
            raise ToolError(observation["text"])
        if observation.get("info", {}).get("tool_error"):
            raise RuntimeError(observation["text"])
        return observation["text"]


@dataclass(frozen=True, kw_only=True)
class OpenEnvOptions:
    """An OpenEnv environment server (``env.name: openenv``), one WebSocket session per game."""

    url: str = ""
    """The server's base URL, e.g. http://127.0.0.1:8000 (ws:// also accepted)."""
    codec: Literal["text", "openspiel_blackjack"] = "text"
    """How observations become prompts and completions become actions. text: a ray_forge env
    served by ``envs/openenv_server.py``; openspiel_blackjack: OpenEnv's OpenSpiel BlackJack."""
    kind: str = "blackjack"
    """The registered env the server plays (``envs/registry.py``): the job uses its evaluation,
    probe prompts, pictures and tokenizer texts, with its own options (``env.options.<kind>``);
    OpenSpiel's BlackJack is blackjack."""
    concurrency: int = 8
    """Games stepped at once per env actor (each game is its own session on the server)."""
    connect_timeout_s: float = 10.0
    """Longest wait for a game's WebSocket session to open."""
    message_timeout_s: float = 60.0
    """Longest wait for one reset or step answer."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url is empty: give the OpenEnv server's URL, e.g. http://127.0.0.1:8000")


SPEC = EnvSpec(name="openenv", options=OpenEnvOptions,
               factory=lambda options, penalty: EnvMaker(lambda: OpenEnvTextEnv(options, penalty)),
               plays=lambda options: options.kind, concurrency=lambda options: options.concurrency)
