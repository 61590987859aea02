"""Strict config: frozen dataclasses loaded from YAML, with dotted CLI overrides.

Every section is a frozen, keyword-only dataclass. Loading walks the dataclass
types, so an unknown key or a value of the wrong type is an error that names the
full dotted key (``trainer.lr``), never a silent default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key is unknown, missing or of the wrong type."""


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Build ``cls`` from a YAML file plus ``key.sub=value`` overrides (YAML-typed values)."""
    raw: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value.strip() else "")
    return from_dict(cls, raw)


def from_dict(cls: type[T], raw: Any, prefix: str = "") -> T:
    """Recursively build dataclass ``cls`` from plain data, checking keys and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        # A section's RENAMED says where a key it used to have went: one line naming the new key.
        if moved := getattr(cls, "RENAMED", {}).get(unknown[0]):
            raise ConfigError(f"{_join(prefix, unknown[0])} is now {moved}")
        known = ", ".join(sorted(fields))
        raise ConfigError(f"unknown config key {_join(prefix, unknown[0])!r} (known keys here: {known})")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, _join(prefix, name))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:  # a required field was not given; a section's own check
        raise ConfigError(f"{prefix or 'config'}: {err}") from err


def to_dict(config: Any) -> dict[str, Any]:
    """Plain data for YAML/JSON dumps (the run directory keeps the resolved config)."""
    return dataclasses.asdict(config)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_tp, *_rest) = typing.get_args(tp)
        return tuple(_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {_coerce(key_tp, k, key): _coerce(val_tp, v, f"{key}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads "3e-5" (no dot) as a string; users mean a float.
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected float, got str {value!r}") from None
    if tp is Any:
        return value
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
