"""Run metrics: one JSON line per step in the run directory, Ray metrics, and a progress bar.

Under Ray, the step's headline numbers are also gauges from ``ray.util.metrics``: every node
exports them for Prometheus on its metrics port (as ``ray_forge_<name>``, tagged with the run),
so the Ray dashboard's Grafana and ``cluster/grafana-dashboard.json`` chart them live.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from collections.abc import Awaitable
from typing import Any, TextIO

from tqdm import tqdm

from ray_forge import identity
from ray_forge.config import to_dict
from ray_forge.observe.trackers import Tracker, open_trackers

EXPORTED = {
    "train_reward": "Mean reward of the games in the step's training batch",
    "eval_return": "Return of the greedy policy at the last evaluation",
    "loss": "GRPO loss of the step",
    "kl": "KL divergence to the reference model",
    "policy_lag": "Policy versions between the weights that sampled a trained token and the trainer's (token mean)",
    "policy_lag_max": "Largest policy lag of a trained token in the step",
    "gen_paused_s": "Seconds an engine stood still for the step's weight update (slowest engine)",
    "episodes_per_s": "Games finished per second of rollout",
    "tokens_per_s": "Tokens generated per second of rollout",
    "weight_sync_s": "Seconds to move the step's weights from trainer to every policy",
    "buffer_size": "Games waiting in the replay buffer",
    "env_errors": "Games of the step that ended with an env error or an invalid action",
    "actor_restarts": "Env actors and policy engines restarted by Ray since the run began",
    "replayed_games": "Games replayed from their seeds because an actor died while playing them",
    "eval_invalid_rate": "Share of the 360 states whose greedy answer the env could not read, at the last evaluation",
    "logprob_diff": "Mean |trainer logprob - engine logprob| of the step's tokens",
    "sync_logprob_max_diff": f"Largest |logprob difference| between {identity.policy(0)} and the trainer after a sync",
}
"""Row keys exported as Ray gauges, with their descriptions (``forge_`` + key; Ray adds ``ray_``)."""


METRICS_FILE = "metrics.jsonl"
"""A run's metrics rows, one JSON object per line, in its run directory."""


class RayGauges:
    """One ``ray.util.metrics.Gauge`` per exported key, tagged ``run=<run name>``."""

    def __init__(self, run: str) -> None:
        from ray.util.metrics import Gauge

        self._gauges = {key: Gauge(f"forge_{key}", description=text, tag_keys=("run",))
                        for key, text in EXPORTED.items()}
        for gauge in self._gauges.values():
            gauge.set_default_tags({"run": run})

    def record(self, row: dict[str, Any]) -> None:
        for key, gauge in self._gauges.items():
            if row.get(key) is not None:
                gauge.set(float(row[key]))


class PlainProgress:
    """tqdm's ``set_postfix``/``update``/``close``, printed as one line at most every ``interval_s``
    (and at the last step): ``GRPO step 12/170 (7%), 3.80 s/step, 10:00 left: reward=-0.16``."""

    def __init__(self, total: int, file: TextIO, interval_s: float = 10.0, disable: bool = False,
                 initial: int = 0, desc: str = "GRPO") -> None:
        self.total, self.file, self.interval_s, self.disable, self.desc = total, file, interval_s, disable, desc
        self.n, self.initial, self.postfix = initial, initial, {}
        self._start = self._last = time.monotonic()

    def set_postfix(self, postfix: dict[str, str], refresh: bool = False) -> None:
        self.postfix = postfix

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.disable or (now - self._last < self.interval_s and self.n < self.total):
            return
        self._last = now
        per_step = (now - self._start) / (self.n - self.initial)
        left = tqdm.format_interval(per_step * (self.total - self.n))
        fields = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        print(f"{self.desc} step {self.n}/{self.total} ({100 * self.n // max(1, self.total)}%), {per_step:.2f} s/step, "
              f"{left} left: {fields}", file=self.file, flush=True)

    def close(self) -> None:
        pass


class MetricsLog:
    """Appends ``metrics.jsonl`` rows (flushed each step, so a crashed run keeps its history)."""

    def __init__(self, run_dir: Path, total_steps: int, progress: bool = True, done_steps: int = 0,
                 wall_offset_s: float = 0.0, desc: str = "GRPO", trackers: list[Tracker] = ()) -> None:
        """``done_steps`` and ``wall_offset_s``: where a resumed run's rows left off; ``desc``: the
        progress line's name of the job; ``trackers``: where each row goes besides the file."""
        import ray

        self.trackers = list(trackers)
        self.path = run_dir / METRICS_FILE
        self._file = self.path.open("a")
        self._gauges = RayGauges(run_dir.name) if ray.is_initialized() else None
        self._start = time.monotonic() - wall_offset_s
        self.logged = done_steps
        """The last step whose row is written: that step is closed, its checkpoint saved if one was due."""
        if progress and sys.stderr.isatty():
            self._bar = tqdm(total=total_steps, initial=done_steps, desc=desc, unit="step", file=sys.stderr,
                             dynamic_ncols=True)
        else:  # `ray job logs` and files are no terminal: whole lines there, not carriage-return redraws
            self._bar = PlainProgress(total_steps, sys.stderr, disable=not progress, initial=done_steps,
                                      desc=desc)

    def log(self, step: int, **values: Any) -> dict[str, Any]:
        row = metrics_row(step, time.monotonic() - self._start, values)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self.logged = max(self.logged, step)
        if self._gauges is not None:
            self._gauges.record(row)
        for tracker in self.trackers:
            tracker.log(row)
        return row

    def images(self, pngs: list[Path], step: int) -> None:
        """The run's pictures, to the trackers that show images."""
        for png in pngs:
            for tracker in self.trackers:
                tracker.image(Path(png).stem, Path(png), step)

    def advance(self, **postfix: Any) -> None:
        self._bar.set_postfix({k: _short(v) for k, v in postfix.items() if v is not None}, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        if not self._file.closed:
            self._file.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def open_metrics(run_dir: Path, config, done_steps: int = 0, wall_offset_s: float = 0.0,
                 desc: str = "GRPO") -> MetricsLog:
    """A job's metrics log as its config (``run.steps``, ``run.progress``, ``run.loggers``) asks."""
    loggers = getattr(config.run, "loggers", ())  # an SFT run writes its jsonl only
    trackers = open_trackers(loggers, run_dir, to_dict(config), done_steps) if loggers else []
    return MetricsLog(run_dir, config.run.steps, progress=config.run.progress, done_steps=done_steps,
                      wall_offset_s=wall_offset_s, desc=desc, trackers=trackers)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def metrics_row(step: int, wall_time_s: float, values: dict[str, Any]) -> dict[str, Any]:
    """One ``metrics.jsonl`` row as it is written: floats to 6 places, NaN as null."""
    return {"step": step, "wall_time_s": round(wall_time_s, 3), **{k: _plain(v) for k, v in values.items()}}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 6)
    return value


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


async def timed(work: Awaitable | None, key: str) -> tuple[Any, dict[str, float]]:
    """(what ``work`` returns, {key: seconds it took}); (None, {}) for no work: a metrics row
    gets a duration only for what ran."""
    if work is None:
        return None, {}
    start = time.monotonic()
    result = await work
    return result, {key: time.monotonic() - start}
