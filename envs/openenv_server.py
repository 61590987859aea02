"""Serve a ray_forge env as an OpenEnv environment server (OpenEnv's own ``create_app``).

    python -m envs.openenv_server --port 8000                               # BlackJack
    python -m envs.openenv_server --env code --port 8001 limits.wall_s=5

The env is any registered one (``envs/registry.py``), its options dotted overrides of its own
section (what a job config says under ``env.options``). Any
OpenEnv client drives it over the WebSocket ``/ws``, one env per session, e.g.
``GenericEnvClient(base_url="http://127.0.0.1:8000").sync()``: ``reset(seed=3)``, then
``step({"text": "HIT"})``. ray_forge's own adapter (``env.name: openenv``, codec ``text``)
trains against it.
"""

from __future__ import annotations

import argparse
import json
import secrets
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

from envs.registry import SPECS, get
from ray_forge.config import load_config
from ray_forge.config.schema import EnvConfig
from ray_forge.core.env import EnvSetup, TextEnv

DEFAULT_PENALTY = EnvConfig().invalid_action_penalty


class TextAction(Action):
    text: str = Field(description="The model's completion")


class TextObservation(Observation):
    text: str = Field(default="", description="The prompt, or the outcome when done")
    action_words: list[str] | None = Field(default=None, description="Valid actions, if a small set of words")
    error: str | None = Field(default=None, description="Why the episode ended early")
    info: dict[str, Any] = Field(default_factory=dict)


class TextEnvState(State):
    env: str = ""
    seed: int | None = None


class TextEnvironment(Environment[TextAction, TextObservation, TextEnvState]):
    """One ray_forge ``TextEnv`` behind OpenEnv's interface."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session gets its own env instance

    def __init__(self, env: TextEnv, name: str) -> None:
        super().__init__()
        self._env, self._in_episode = env, False
        self._words = list(env.action_words) if env.action_words else None
        self._state = TextEnvState(env=name)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextObservation:
        seed = secrets.randbelow(2**31) if seed is None else seed
        self._state = TextEnvState(env=self._state.env, seed=seed, episode_id=episode_id or secrets.token_hex(8))
        self._in_episode = True
        return TextObservation(text=self._env.reset(seed), action_words=self._words)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        if not self._in_episode:
            raise RuntimeError("step before reset: call reset to start an episode")
        result = self._env.step(action.text)
        self._state.step_count += 1
        self._in_episode = not result.done
        info = json.loads(json.dumps(result.info, default=str))  # the wire takes JSON only
        return TextObservation(text=result.observation, reward=result.reward, done=result.done,
                               action_words=self._words, error=info.pop("error", None), info=info)

    @property
    def state(self) -> TextEnvState:
        return self._state


def create_server_app(env: EnvSetup, invalid_action_penalty: float = DEFAULT_PENALTY, max_sessions: int = 64):
    """The FastAPI app: ``/ws`` sessions, plus OpenEnv's ``/reset``, ``/step``, ``/health``, ``/schema``."""
    if env.spec.name == "openenv":
        raise ValueError("env openenv is a client of another server; serve an env that plays itself")
    make = env.make_env(invalid_action_penalty)
    return create_app(lambda: TextEnvironment(make(), env.spec.name), TextAction, TextObservation,
                      env_name=env.spec.name, max_concurrent_envs=max_sessions)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="blackjack", help=f"a registered env ({', '.join(SPECS)})")
    parser.add_argument("--invalid-action-penalty", type=float, default=DEFAULT_PENALTY,
                        help="reward of a game ended by an unreadable answer (a job's env.invalid_action_penalty)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=int, default=64, help="concurrent WebSocket sessions")
    parser.add_argument("overrides", nargs="*", help="the env's options, dotted, e.g. limits.wall_s=5")
    args = parser.parse_args(argv)
    spec = get(args.env, "--env")
    env = EnvSetup(spec, load_config(spec.options, None, args.overrides))
    app = create_server_app(env, args.invalid_action_penalty, args.max_sessions)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
