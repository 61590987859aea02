"""The env registry: every env's spec by name. A new env is a folder exporting ``SPEC`` and one
line here (see the README's "Add your own env")."""

from __future__ import annotations

import dataclasses

from envs import blackjack, code, openenv_adapter
from ray_forge.config import ConfigError
from ray_forge.config.schema import EnvConfig
from ray_forge.core.env import EnvSetup, EnvSpec

SPECS: dict[str, EnvSpec] = {spec.name: spec for spec in (
    blackjack.SPEC,
    code.SPEC,
    openenv_adapter.SPEC,
)}


def register(spec: EnvSpec) -> None:
    """Add an env defined outside this folder (a test, a user's package) under ``spec.name``."""
    if spec.name in SPECS and SPECS[spec.name] is not spec:
        raise ValueError(f"an env named {spec.name!r} is registered already")
    SPECS[spec.name] = spec


def get(name: str, key: str = "env.name") -> EnvSpec:
    if not name:
        raise ConfigError(f"{key} is not set: name the env to play ({', '.join(sorted(SPECS))})")
    if name not in SPECS:
        raise ConfigError(f"{key}: no env named {name!r} (registered: {', '.join(sorted(SPECS))})")
    return SPECS[name]


def setup(env: EnvConfig) -> EnvSetup:
    """The run's env (``env.name``) with its options, and the env it plays if it plays another's
    games; every section of ``env.options`` must name a registered env and be valid for it."""
    checked = {name: get(name, f"env.options.{name}").setup(options) for name, options in env.options.items()}

    def setup_of(name: str) -> EnvSetup:
        return checked.get(name) or get(name).setup({})

    run = setup_of(env.name)
    if run.spec.plays is None:
        return run
    name = run.spec.plays(run.options)
    if name == run.spec.name or get(name, f"{run.spec.key}: it plays").plays is not None:
        raise ConfigError(f"{run.spec.key}: it plays {name!r}, which plays no games of its own")
    return dataclasses.replace(run, played=setup_of(name))
