"""Checkpoints in the run directory: written atomically, verified by checksums, the last N kept.

Layout: ``<run_dir>/checkpoints/step-00000010/`` holds the trainer's sharded state (``trainer/``,
written by every rank through torch.distributed.checkpoint), the driver's state (``driver.pkl``)
and, written last, ``manifest.json`` with the size and SHA-256 of every other file. A checkpoint
is built under a temporary name, its files fsynced, then renamed into place; only then is the
manifest written (temporary name, fsync, rename). A folder without a manifest, or whose files do
not match it, is skipped on resume with a warning, in favour of the one before.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from ray_forge.core.cadence import every

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DRIVER_STATE = "driver.pkl"
BUFFER_STATE = "buffer.pkl"
"""The replay buffer's contents, written by the buffer actor itself (no game passes through the driver)."""
TRAINER_DIR = "trainer"
DCP_METADATA = f"{TRAINER_DIR}/.metadata"


def rank_file(rank: int) -> str:
    """A trainer rank's LR schedule, version and RNG state, beside the DCP shards."""
    return f"{TRAINER_DIR}/rank-{rank}.pt"
_PREFIX = "step-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where step ``step`` is built; a leftover from a crashed attempt is removed first."""
    path = checkpoints_dir(run_dir) / f".{_PREFIX}{step:08d}.partial"
    shutil.rmtree(path, ignore_errors=True)
    try:
        (path / TRAINER_DIR).mkdir(parents=True)
    except OSError as err:
        raise _write_error(run_dir, step, err) from err
    return path


def commit(run_dir: Path, step: int, staging: Path, driver_state: dict[str, Any], keep: int,
           expected: list[str] = ()) -> Path:
    """Add the driver's state to ``staging`` (whose trainer part is written), make it the
    checkpoint of ``step``, and keep only the newest ``keep``. On any error the previous
    checkpoints are untouched and the partial one is removed. ``expected`` files (relative
    paths) must be there: a rank that wrote elsewhere must not yield a checkpoint that verifies."""
    final = checkpoints_dir(run_dir) / f"{_PREFIX}{step:08d}"
    missing = [name for name in expected if not (staging / name).is_file()]
    if missing:
        raise failed(run_dir, step, staging, FileNotFoundError(f"{', '.join(missing)} not written (is {run_dir} "
                                                               "on storage every trainer rank shares?)"))
    try:
        with open(staging / DRIVER_STATE, "wb") as f:
            pickle.dump(driver_state, f, protocol=pickle.HIGHEST_PROTOCOL)
        files = _fsync_and_hash(staging)
        shutil.rmtree(final, ignore_errors=True)  # an unfinished one of the same step, from before a crash
        os.rename(staging, final)
        _fsync_dir(final.parent)
        manifest = dict(step=step, files=files)
        tmp = final / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final / MANIFEST)
        _fsync_dir(final)
    except OSError as err:
        shutil.rmtree(final, ignore_errors=True)
        raise failed(run_dir, step, staging, err) from err
    _prune(run_dir, keep)
    return final


def failed(run_dir: Path, step: int, staging: Path, err: BaseException) -> CheckpointError:
    """Remove what step ``step`` wrote so far and say why it failed (a full disk, ...)."""
    shutil.rmtree(staging, ignore_errors=True)
    return _write_error(run_dir, step, err)


def _write_error(run_dir: Path, step: int, err: BaseException) -> CheckpointError:
    previous = latest(run_dir, quiet=True)
    kept = f"the previous checkpoint {previous.name} is intact" if previous else "there is no earlier checkpoint"
    return CheckpointError(f"checkpoint of step {step} could not be written in {checkpoints_dir(run_dir)}: "
                           f"{getattr(err, 'strerror', None) or err} ({err.__class__.__name__}); {kept}")


def problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be used, or None if every file matches its manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (the write did not finish)"
    except (OSError, ValueError) as err:
        return f"unreadable manifest ({err})"
    for name, want in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want["bytes"]:
            return f"{name} is {size} bytes, the manifest says {want['bytes']}"
        if _sha256(file) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def latest(run_dir: Path, quiet: bool = False) -> Path | None:
    """The newest usable checkpoint; every newer one that is not usable is named with its reason."""
    for path in reversed(_step_dirs(run_dir)):
        reason = problem(path)
        if reason is None:
            return path
        if not quiet:
            log.warning("checkpoint %s skipped: %s", path.name, reason)
    return None


def read_driver_state(path: Path) -> dict[str, Any]:
    with open(path / DRIVER_STATE, "rb") as f:
        return pickle.load(f)  # our own file, verified against the manifest's checksum


def step_of(path: Path) -> int:
    return int(path.name.removeprefix(_PREFIX))


def _step_dirs(run_dir: Path) -> list[Path]:
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.name.startswith(_PREFIX) and p.is_dir()), key=step_of)


def _prune(run_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` usable checkpoints; older folders (usable or not) go."""
    usable = [p for p in _step_dirs(run_dir) if problem(p) is None]
    if len(usable) <= keep:
        return
    oldest_kept = step_of(usable[-keep])
    for path in _step_dirs(run_dir):
        if step_of(path) < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)


def _fsync_and_hash(root: Path) -> dict[str, dict]:
    files = {}
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        files[str(file.relative_to(root))] = dict(bytes=file.stat().st_size, sha256=_sha256(file))
    for folder in {file.parent for file in root.rglob("*")} | {root}:
        _fsync_dir(folder)
    return files


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Stateful(Protocol):
    """A part of the driver's state: its keys of ``driver.pkl``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Writer(Protocol):
    """A component that writes its own files into the checkpoint being built (the trainer ranks'
    shards, the buffer's games); what it returns is kept in the driver's state under its name."""

    def files(self) -> list[str]: ...

    async def save(self, folder: Path) -> Any: ...

    async def load(self, folder: Path, saved: Any, step: int) -> None: ...


class CheckpointManager:
    """A run's checkpoints in torchtitan's pattern: ``save(step, last_step)`` decides whether one is
    due (every ``every`` steps and at the last), gathers each writer's files and each state's
    ``state_dict()``, and commits them atomically; ``restore`` and ``load`` bring them back."""

    def __init__(self, run_dir: Path, every_n: int, keep: int, resume_from: Path | None = None) -> None:
        self.run_dir, self.every_n, self.keep, self.resume_from = Path(run_dir), every_n, keep, resume_from
        self.states: dict[str, Stateful] = {}
        self.writers: dict[str, Writer] = {}

    def add(self, **components: Stateful | Writer) -> None:
        for name, component in components.items():
            (self.writers if hasattr(component, "files") else self.states)[name] = component

    async def save(self, step: int, last_step: bool = False) -> float | None:
        """Step ``step``'s checkpoint if one is due; seconds it took, or None."""
        if not (last_step or every(self.every_n, step)):
            return None
        start = time.monotonic()
        driver: dict[str, Any] = dict(step=step)
        for name, state in self.states.items():
            part = state.state_dict()
            if clash := part.keys() & (driver.keys() | self.writers.keys()):
                raise ValueError(f"the checkpoint's {name} state and another part both hold {sorted(clash)}")
            driver.update(part)
        staging = await asyncio.to_thread(staging_dir, self.run_dir, step)
        try:
            for name, writer in self.writers.items():  # in the order added: the trainer's shards first
                driver[name] = await writer.save(staging)
        except CheckpointError as err:  # a rank could not write its shards (a full disk, ...)
            raise failed(self.run_dir, step, staging, err) from None
        expected = [file for writer in self.writers.values() for file in writer.files()]
        await asyncio.to_thread(commit, self.run_dir, step, staging, driver, self.keep, expected)
        return time.monotonic() - start

    def restore(self) -> dict[str, Any] | None:
        """The resumed checkpoint's driver state, loaded into every state added so far; None for a
        fresh start."""
        if self.resume_from is None:
            return None
        saved = read_driver_state(self.resume_from)
        for state in self.states.values():
            state.load_state_dict(saved)
        return saved

    async def attach(self, saved: dict[str, Any] | None, **components: Stateful | Writer) -> None:
        """Components made after ``restore`` (actors, and what counts them): part of every checkpoint
        from now on, and loaded from ``saved`` (the resumed checkpoint's driver state) if there is one."""
        self.add(**components)
        for name, component in components.items() if saved is not None else ():
            if name in self.writers:
                await component.load(self.resume_from, saved.get(name), saved["step"])  # older checkpoints: no trainer entry
            else:
                component.load_state_dict(saved)


class RandomState:
    """The driver's RNGs (Python's and torch's) as a part of its checkpointed state."""

    def state_dict(self) -> dict[str, Any]:
        return dict(rng=dict(python=random.getstate(), torch=torch.get_rng_state()))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
