"""Coding and math environments whose rewards come from executing code.

Exports ``SPEC`` (``envs/code/spec.py``) on first use only: the sandbox (``envs.code.sandbox``)
must import with the standard library alone, as its own host process and tests run it."""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("SPEC", "CodeOptions"):
        from envs.code import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'envs.code' has no attribute {name!r}")
