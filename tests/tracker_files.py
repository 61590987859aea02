"""Reading back what the trackers wrote, with TensorBoard's own reader and wandb's record format."""

from __future__ import annotations

import struct
from pathlib import Path


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar event under ``run_dir/tensorboard`` (TensorBoard's reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def tensorboard_images(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return set(EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0}).Reload().Tags()["images"])


def wandb_history(run_dir: Path) -> list[dict[str, str]]:
    """Every history record of the offline wandb run in ``run_dir``: {key: JSON value}, step included.

    The ``.wandb`` file is a LevelDB-style log (wandb's own format): a 7-byte header, then 32 KiB
    blocks of records, each with a 7-byte header (CRC, length, type) and a serialized ``Record``."""
    from wandb.proto import wandb_internal_pb2

    [path] = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))[-1:]
    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", path
    history, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                history.append({item.key or "/".join(item.nested_key): item.value_json
                                for item in record.history.item})
    return history


def assert_trackers_hold_every_scalar(run_dir: Path, images: set[str]) -> None:
    """Every number of ``metrics.jsonl`` is in TensorBoard and in the offline wandb run at its step,
    nothing else is, and the pictures ``images`` reached both."""
    import json
    import math

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    wanted = {(key, row["step"]): value for row in rows for key, value in row.items()
              if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    board = tensorboard_scalars(run_dir)
    assert {(key, step) for key, steps in board.items() for step in steps} == set(wanted)
    assert all(math.isclose(board[k][s], v, rel_tol=1e-6, abs_tol=1e-6) for (k, s), v in wanted.items())
    assert tensorboard_images(run_dir) == images
    history = wandb_history(run_dir)
    logged = {(key, int(h["_step"])): float(v) for h in history for key, v in h.items()
              if not key.startswith(("_", *images))}
    assert logged.keys() == wanted.keys()
    assert all(math.isclose(logged[k], v, rel_tol=1e-9, abs_tol=1e-9) for k, v in wanted.items())
    assert {name for name in images if any(key.startswith(name) for h in history for key in h)} == images
