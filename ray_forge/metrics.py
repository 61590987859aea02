"""Run metrics: one JSON line per step in the run directory, and a console progress bar."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm


class MetricsLog:
    """Appends ``metrics.jsonl`` rows (flushed each step, so a crashed run keeps its history)."""

    def __init__(self, run_dir: Path, total_steps: int, progress: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._start = time.monotonic()
        # `ray job logs` is not a terminal: print a plain line per update there instead of redraws.
        self._bar = tqdm(total=total_steps, desc="GRPO", unit="step", file=sys.stderr,
                         disable=not progress, dynamic_ncols=True, mininterval=0 if sys.stderr.isatty() else 5)

    def log(self, step: int, **values: Any) -> dict[str, Any]:
        row = {"step": step, "wall_time_s": round(time.monotonic() - self._start, 3)}
        row.update({k: _plain(v) for k, v in values.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
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
