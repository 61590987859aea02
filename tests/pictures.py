"""Reading a PNG back to show that it was drawn: a file's size says nothing of what is in it.

A picture was drawn when enough of it is inked, each line the plot was told to draw spans much of
the axes' width in its colour, and each filled area covers the pixels asked for. A legend handle
or a lone marker has the line's colour too, but spans only about 30 or 10 pixel columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

LINE_COLUMNS = 200
"""Pixel columns a line's colour spans when it joins two steps or more (the axes are about
1100 px wide; a later line drawn over it may hide half of it)."""
CELLS = 10_000
"""Pixels of a colour that fills a few cells of a decision table (one cell has about 900)."""
MIN_INKED = 0.02
"""Share of pixels that are not white: a figure with one empty axes and its title has 0.013."""
TOLERANCE = 10
"""How far (0-255, per channel) a pixel may be from a colour and still count as it."""

STICK, HIT, UNREADABLE = "#4c72b0", "#dd8452", "#8c8c8c"
"""The BlackJack decision table's cell colours (``envs/blackjack/plots.py``)."""


def assert_drawn(path: str | Path, lines: tuple[str, ...] = (), areas: Mapping[str, int] | None = None) -> None:
    """The PNG at ``path`` is inked; each colour in ``lines`` spans ``LINE_COLUMNS`` pixel
    columns; each colour in ``areas`` covers at least the pixels it maps to."""
    from matplotlib.image import imread

    rgb = np.round(imread(Path(path))[..., :3] * 255).astype(int)  # [H, W, 3]
    inked = float((rgb.min(axis=-1) < 250).mean())
    assert inked >= MIN_INKED, f"{path}: only {inked:.3f} of the pixels are inked"
    columns = {colour: int(_is(rgb, colour).any(axis=0).sum()) for colour in lines}
    assert all(n >= LINE_COLUMNS for n in columns.values()), f"{path}: columns spanned by each line {columns}"
    areas = areas or {}
    covered = {colour: int(_is(rgb, colour).sum()) for colour in areas}
    assert all(covered[c] >= areas[c] for c in areas), f"{path}: pixels {covered}, wanted {dict(areas)}"


def _is(rgb: np.ndarray, colour: str) -> np.ndarray:
    """[H, W] bool: the pixels within ``TOLERANCE`` of ``colour`` (any matplotlib colour spec)."""
    from matplotlib.colors import to_rgb

    target = np.round(np.array(to_rgb(colour)) * 255).astype(int)
    return np.abs(rgb - target).max(axis=-1) <= TOLERANCE


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    import struct

    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])
