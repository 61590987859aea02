"""The env registry: a name and its config section in, a maker of ``TextEnv``s out.

Shared by the env pool actor and the OpenEnv server, so both build envs the same way.
"""

from __future__ import annotations

from typing import Callable

from ray_forge.core.env import TextEnv

NAMES = ("blackjack", "code", "openenv")


def env_factory(name: str, invalid_action_penalty: float = -1.0, options: dict | None = None) -> Callable[[], TextEnv]:
    """``options`` is the env's own config section (``env.code``, ``env.openenv``) as a dict."""
    options = options or {}
    if name == "blackjack":
        from envs.blackjack import BlackjackTextEnv

        return lambda: BlackjackTextEnv(invalid_action_penalty=invalid_action_penalty)
    if name == "code":
        from envs.code import code_env_factory

        return code_env_factory(**options)
    if name == "openenv":
        from envs.openenv_adapter import openenv_factory

        return openenv_factory(invalid_action_penalty=invalid_action_penalty, **options)
    raise ValueError(f"unknown env {name!r} (known: {', '.join(NAMES)})")
