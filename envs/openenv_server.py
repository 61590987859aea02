"""Serve a ray_forge env as an OpenEnv environment server (OpenEnv's own ``create_app``).

    python -m envs.openenv_server --port 8000                               # BlackJack
    python -m envs.openenv_server --env code --port 8001 limits.wall_s=5

The env is any registered one (``envs/registry.py``), its options dotted overrides of its own
section (what a job config says under ``env.options``). Any
OpenEnv client drives it over the WebSocket ``/ws``, one env per session, e.g.
``GenericEnvClient(base_url="http://127.0.0.1:8000").sync()``: ``reset(seed=3)``, then
``step({"text": "HIT"})``. An env with tools (the code env's python tool) lists their schemas
in every observation, and ``step({"tool": "python", "arguments": {"code": "print(1)"}})`` calls
one mid-episode. ray_forge's own adapter (``env.name: openenv``, codec ``text``) trains against
it, tool calls included.
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
from ray_forge.core.tools import ToolError

DEFAULT_PENALTY = EnvConfig().invalid_action_penalty


class TextAction(Action):
    text: str = Field(default="", description="The model's completion")
    tool: str | None = Field(default=None, description="Call this tool of the episode instead (the episode goes on)")
    arguments: dict[str, Any] = Field(default_factory=dict, description="The tool call's arguments")


class TextObservation(Observation):
    text: str = Field(default="", description="The prompt, or the outcome when done")
    action_words: list[str] | None = Field(default=None, description="Valid actions, if a small set of words")
    error: str | None = Field(default=None, description="Why the episode ended early")
    info: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict[str, Any]] | None = Field(default=None, description="The episode's tools (function schemas)")


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
        self._tools = [tool.schema for tool in env.tools()] or None
        self._state = TextEnvState(env=name)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextObservation:
        seed = secrets.randbelow(2**31) if seed is None else seed
        self._state = TextEnvState(env=self._state.env, seed=seed, episode_id=episode_id or secrets.token_hex(8))
        self._in_episode = True
        return TextObservation(text=self._env.reset(seed), action_words=self._words, tools=self._tools)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        if not self._in_episode:
            raise RuntimeError("step before reset: call reset to start an episode")
        if action.tool is not None:
            return self._call_tool(action.tool, action.arguments)
        result = self._env.step(action.text)
        self._state.step_count += 1
        self._in_episode = not result.done
        info = json.loads(json.dumps(result.info, default=str))  # the wire takes JSON only
        return TextObservation(text=result.observation, reward=result.reward, done=result.done,
                               action_words=self._words, error=info.pop("error", None), info=info)

    def _call_tool(self, name: str, arguments: dict) -> TextObservation:
        """A tool call of this episode (the python tool's session is the env's own): its output,
        and in ``info["tool_error"]`` why it failed (``raised``: the code failed; ``failed``: the call)."""
        tools = {tool.name: tool for tool in self._env.tools()}
        if name not in tools:
            return TextObservation(text=f"there is no tool {name[:64]!r}; the tools are {sorted(tools)}",
                                   info={"tool_error": "unknown_tool"}, tools=self._tools)
        try:
            return TextObservation(text=tools[name](arguments), tools=self._tools)
        except ToolError as err:
            return TextObservation(text=str(err), info={"tool_error": "raised"}, tools=self._tools)
        except Exception as err:  # the call itself failed: the model is told, the episode goes on
            return TextObservation(text=f"{type(err).__name__}: {err}", info={"tool_error": "failed"},
                                   tools=self._tools)

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
