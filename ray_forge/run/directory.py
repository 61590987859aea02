"""Run directories: a fresh one per run, or an existing one to resume (``--resume PATH|auto``)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from ray_forge.config import ConfigError, load_config, to_dict
from ray_forge.config.schema import JobConfig
from ray_forge.core import checkpoint
from ray_forge.core.checkpoint import CheckpointManager
from ray_forge.models.tiny import check_model_dir, make_tiny_qwen3
from ray_forge.observe.metrics import METRICS_FILE, metrics_row

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
FINISHED_FILE = "eval.json"
"""Written when a run has ended; ``--resume auto`` starts afresh after a finished run."""
EVALUATIONS_DIR = "evaluations"
"""Each evaluation's whole result, one file per step (``jobs/grpo.py``)."""


@dataclass(frozen=True)
class Run:
    config: JobConfig
    run_dir: Path
    resume_from: Path | None
    """The checkpoint to continue from; None for a fresh start (also of a resumed run that had none)."""
    resumed: bool = False
    """The run directory exists already (``--resume``)."""


def open_run(config_path: str, overrides: list[str], resume: str | None, cls: type = JobConfig,
             fixed: tuple[str, ...] | None = None) -> Run:
    """The run to do (of a ``cls`` config: the GRPO job's, or another job's with its own
    ``fixed`` keys). Nothing is created on disk here: :func:`create` does that once the model
    and config have been checked."""
    fixed = FIXED_ON_RESUME if fixed is None else fixed
    config = load_config(cls, config_path, overrides)
    if resume is None:
        return Run(config, new_run_dir(config), None)
    run_dir = latest_unfinished(config) if resume == "auto" else Path(resume)
    if run_dir is None:
        return Run(config, new_run_dir(config), None)
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"--resume {run_dir}: not a run directory (it has no {CONFIG_FILE})")
    # The run keeps its own config; command-line overrides (e.g. more run.steps) apply on top,
    # except those that would change what the checkpoint's batches and shards mean.
    saved = load_run_config(run_dir, cls=cls)
    config = load_run_config(run_dir, overrides, cls)
    for key in fixed:
        if _get(saved, key) != _get(config, key):
            raise ConfigError(f"--resume {run_dir}: {key} cannot change on resume ({_get(saved, key)!r} -> "
                              f"{_get(config, key)!r}): the checkpoint's batches, seeds and shards depend on it")
    return Run(config, run_dir.resolve(), checkpoint.latest(run_dir), resumed=True)


def load_run_config(run_dir: Path, overrides: list[str] = (), cls: type = JobConfig) -> JobConfig:
    """The config a run kept; one written before a key moved fails saying where it went."""
    try:
        return load_config(cls, run_dir / CONFIG_FILE, overrides)
    except ConfigError as err:
        if " is now " in str(err):
            raise ConfigError(f"{err}; {run_dir / CONFIG_FILE} was written by an older ray_forge: edit it to go "
                              "on") from err
        raise


FIXED_ON_RESUME = ("run.seed", "grpo.prompts_per_step", "grpo.samples_per_prompt", "trainer.num_ranks", "model.path",
                   "model.tiny", "policy.constrain_to_actions", "env.name")
"""Settings a resumed run keeps from its saved config whatever the command line says."""


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def new_run_dir(config: JobConfig) -> Path:
    return (Path(config.run.output_dir) / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def latest_unfinished(config: JobConfig) -> Path | None:
    """The newest run directory of this config's ``run.name`` (``<name>-YYYYmmdd-HHMMSS``) that has
    not finished, by the time in its name."""
    root = Path(config.run.output_dir)
    if not root.is_dir():
        return None
    pattern = re.compile(re.escape(config.run.name) + r"-\d{8}-\d{6}")
    runs = sorted(p for p in root.iterdir() if pattern.fullmatch(p.name) and (p / CONFIG_FILE).is_file())
    unfinished = [p for p in runs if not (p / FINISHED_FILE).exists()]
    return unfinished[-1] if unfinished else None


def create(run: Run) -> None:
    """Make a fresh run's directory and write its resolved config (a resumed run has both). A
    ``model.path`` that is no model fails first, leaving nothing behind."""
    if run.config.model.path:
        check_model_dir(run.config.model.path)
    run.run_dir.mkdir(parents=True, exist_ok=run.resumed)
    (run.run_dir / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(run.config), sort_keys=False))
    log.info("run directory: %s%s", run.run_dir, " (resumed)" if run.resumed else "")


def truncate_metrics(run_dir: Path, last_step: int, row: dict | None = None) -> float:
    """Drop rows after ``last_step`` (logged after the checkpoint, and about to be redone), so the
    resumed run appends without duplicate steps. The kill may come between a checkpoint and its
    metrics row: ``row``, the row of ``last_step`` the checkpoint kept, is written then. Returns the
    kept rows' last wall time."""
    path = run_dir / METRICS_FILE
    if not path.exists() and row is None:
        return 0.0
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            parsed = json.loads(line)
        except ValueError:  # a line cut short by the kill
            continue
        if parsed["step"] <= last_step:
            kept.append(parsed)
    wall_s = kept[-1]["wall_time_s"] if kept else 0.0
    if row is not None and (not kept or kept[-1]["step"] != last_step):
        kept.append(metrics_row(last_step, wall_s, row))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return wall_s


def run_namespace(run: Run) -> str:
    """The run's Ray namespace: a resumed run gets one of its own, as the killed attempt's named
    actors may not be gone yet."""
    return run.run_dir.name + (f"-resumed-{time.strftime('%H%M%S')}" if run.resumed else "")


def start_point(run: Run, checkpoints: CheckpointManager) -> tuple[dict | None, float]:
    """Where a run starts: the resumed checkpoint's driver state, loaded into the parts of it added
    so far (None for a fresh start), and the wall time its clock goes on from. Metrics rows after
    the checkpoint are cut off (the resumed run writes them again)."""
    if run.resume_from is None:
        if run.resumed:  # stopped before its first checkpoint: start it again from step 0
            log.warning("%s has no usable checkpoint: starting it again from step 0", run.run_dir)
        return None, truncate_metrics(run.run_dir, -1) if run.resumed else 0.0
    saved = checkpoints.restore()
    return saved, truncate_metrics(run.run_dir, saved["step"], saved.get("row"))


def base_model(run: Run, corpus: Callable[[], list[str]], chat: bool) -> str:
    """The run's base model: ``model.path``, or a tiny one made in the run directory, its tokenizer
    trained on ``corpus()`` (kept on resume, so the reference model and a restarted engine start
    from the same weights as before)."""
    model = run.config.model
    if model.path:
        return str(check_model_dir(model.path))
    made = run.run_dir / "initial_model"
    if (made / "config.json").is_file():
        return str(check_model_dir(made))
    return str(make_tiny_qwen3(made, corpus(), model.tiny, chat=chat))
