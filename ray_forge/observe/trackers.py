"""Where a run's rows go besides ``metrics.jsonl`` (``run.loggers``): TensorBoard and Weights & Biases.

Each tracker gets every row ``metrics.jsonl`` gets, at the same step, and the run's pictures at the
end. Nothing waits on a network: wandb runs offline unless ``WANDB_API_KEY`` is set (or
``WANDB_MODE`` says otherwise), says so, and ``wandb sync`` uploads the run later.
"""

from __future__ import annotations

import logging
import os
from numbers import Real
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

TRACKERS = ("jsonl", "tensorboard", "wandb")
"""What ``run.loggers`` may list; ``jsonl`` is always written, listed or not."""
TENSORBOARD_DIR = "tensorboard"


class Tracker(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...
    def image(self, name: str, png: Path, step: int) -> None: ...
    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A row's numbers (not its step, flags or missing values)."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, Real) and not isinstance(v, bool)}


class TensorBoard:
    """Event files in ``<run_dir>/tensorboard``; a resumed run drops the events after its checkpoint."""

    def __init__(self, run_dir: Path, resumed_at: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=resumed_at + 1 if resumed_at else None)

    def log(self, row: dict[str, Any]) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, row["step"])
        self.writer.flush()

    def image(self, name: str, png: Path, step: int) -> None:
        from matplotlib.image import imread

        self.writer.add_image(name, imread(png)[..., :3], step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class Wandb:
    """A wandb run in the run directory, offline unless an API key (or ``WANDB_MODE``) says otherwise."""

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if mode == "offline":
            log.info("wandb: offline (no WANDB_API_KEY); the run stays in %s/wandb, `wandb sync` uploads it", run_dir)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ray_forge"), name=run_dir.name, dir=str(run_dir),
                              mode=mode, config=config, settings=wandb.Settings(silent=True, init_timeout=60))

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=row["step"])

    def image(self, name: str, png: Path, step: int) -> None:
        self.run.log({name: self.wandb.Image(str(png))}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(names: tuple[str, ...], run_dir: Path, config: dict[str, Any], resumed_at: int) -> list[Tracker]:
    """The trackers ``run.loggers`` names, besides the jsonl file every run writes."""
    made: list[Tracker] = []
    if "tensorboard" in names:
        made.append(TensorBoard(run_dir, resumed_at))
    if "wandb" in names:
        made.append(Wandb(run_dir, config))
    return made
