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
from typing import Any

from tqdm import tqdm


EXPORTED = {
    "train_reward": "Mean reward of the games in the step's training batch",
    "eval_return": "Return of the greedy policy at the last evaluation",
    "loss": "GRPO loss of the step",
    "kl": "KL divergence to the reference model",
    "policy_lag": "Policy versions between the weights that played a batch and the trainer's",
    "episodes_per_s": "Games finished per second of rollout",
    "tokens_per_s": "Tokens generated per second of rollout",
    "weight_sync_s": "Seconds to move the step's weights from trainer to every policy",
    "buffer_size": "Games waiting in the replay buffer",
    "env_errors": "Games of the step that ended with an env error or an invalid action",
}
"""Row keys exported as Ray gauges, with their descriptions (``forge_`` + key; Ray adds ``ray_``)."""


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


class MetricsLog:
    """Appends ``metrics.jsonl`` rows (flushed each step, so a crashed run keeps its history)."""

    def __init__(self, run_dir: Path, total_steps: int, progress: bool = True) -> None:
        import ray

        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._gauges = RayGauges(run_dir.name) if ray.is_initialized() else None
        self._start = time.monotonic()
        # `ray job logs` is not a terminal: print a plain line per update there instead of redraws.
        self._bar = tqdm(total=total_steps, desc="GRPO", unit="step", file=sys.stderr,
                         disable=not progress, dynamic_ncols=True, mininterval=0 if sys.stderr.isatty() else 5)

    def log(self, step: int, **values: Any) -> dict[str, Any]:
        row = {"step": step, "wall_time_s": round(time.monotonic() - self._start, 3)}
        row.update({k: _plain(v) for k, v in values.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._gauges is not None:
            self._gauges.record(row)
        return row

    def advance(self, **postfix: Any) -> None:
        self._bar.set_postfix({k: _short(v) for k, v in postfix.items() if v is not None}, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 6)
    return value


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
