"""PNG figures written at the end of a run (matplotlib's object API: no display, no pyplot state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

SIZE_IN, DPI = (12.0, 8.0), 100  # 1200 x 800 px


def figure(size_in: tuple[float, float] = SIZE_IN):
    from matplotlib.figure import Figure

    return Figure(figsize=size_in, dpi=DPI, layout="constrained")


def save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    return path


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window:
        return values
    kernel = np.ones(window) / window
    head = np.array([values[: i + 1].mean() for i in range(window - 1)])
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def learning_curve_png(rows: list[dict[str, Any]], path: str | Path, title: str = "",
                       references: dict[str, float] | None = None,
                       below: tuple[str, str, tuple[float, float] | None] | None = None) -> Path:
    """Train reward (raw and smoothed) and evaluation return per step; below, the loss, or the
    metric ``below`` names: (its key in the rows, its axis label, its y limits or None).

    ``references`` draws labelled horizontal lines (e.g. the optimal policy's return)."""
    fig = figure()
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    steps = np.array([r["step"] for r in rows])
    reward = np.array([r.get("train_reward", np.nan) for r in rows], dtype=float)
    top.plot(steps, reward, color="tab:blue", alpha=0.3, lw=1, label="train reward (step mean)")
    top.plot(steps, _smooth(reward, max(1, len(rows) // 20)), color="tab:blue", lw=2, label="train reward (smoothed)")
    evals = [(r["step"], r["eval_return"]) for r in rows if r.get("eval_return") is not None]
    if evals:
        top.plot(*zip(*evals), "o-", color="tab:green", lw=2, label="greedy policy return (eval)")
    for i, (name, value) in enumerate((references or {}).items()):
        top.axhline(value, ls="--", lw=1.2, color=f"C{3 + i}", label=name)
    top.set_ylabel("return per game")
    top.legend(loc="lower right")
    top.grid(alpha=0.3)
    key, label, limits = below or (None, "", None)
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if points:
        bottom.plot(*zip(*points), "o-", color="tab:purple", lw=2)
        bottom.set_ylabel(label)
        if limits:
            bottom.set_ylim(*limits)
    else:
        bottom.plot(steps, [r.get("loss", np.nan) for r in rows], color="tab:red")
        bottom.set_ylabel("loss")
    bottom.set_xlabel("training step")
    bottom.grid(alpha=0.3)
    fig.suptitle(title or "learning curve")
    return save(fig, path)


def runs_side_by_side_png(runs: dict[str, list[dict[str, Any]]], path: str | Path, title: str = "",
                          references: dict[str, float] | None = None) -> Path:
    """Evaluation return per step of several runs on one axis, and below it each run's actor
    restarts since it began (flat for an undisturbed run), so faults line up with the curves."""
    fig = figure()
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for i, (label, rows) in enumerate(runs.items()):
        evals = [(r["step"], r["eval_return"]) for r in rows if r.get("eval_return") is not None]
        if evals:
            top.plot(*zip(*evals), "o-", color=f"C{i}", lw=2, label=label)
        bottom.step([r["step"] for r in rows], [r.get("actor_restarts", 0) for r in rows], where="post",
                    color=f"C{i}", lw=2, label=label)
    for i, (name, value) in enumerate((references or {}).items()):
        top.axhline(value, ls="--", lw=1.2, color=f"C{3 + i}", label=name)
    top.set_ylabel("greedy policy return (eval)")
    top.legend(loc="lower right")
    top.grid(alpha=0.3)
    bottom.set_ylabel("actor restarts so far")
    bottom.set_xlabel("training step")
    bottom.legend(loc="upper left")
    bottom.grid(alpha=0.3)
    fig.suptitle(title or "runs side by side")
    return save(fig, path)


def returns_against_time_png(runs: dict[str, list[tuple[float, float]]], path: str | Path, title: str = "",
                             target: float | None = None, references: dict[str, float] | None = None) -> Path:
    """Evaluation return against seconds since the first step, one curve per run (a list of
    (seconds, return)), with the bar each is timed to (``target``) and reference returns."""
    fig = figure((12.0, 6.0))
    axes = fig.subplots()
    for i, (label, points) in enumerate(runs.items()):
        reached = next((t for t, r in points if target is not None and r >= target), None)
        if reached is not None:
            axes.axvline(reached, color=f"C{i}", ls=":", lw=1.5)
            label += f": at the bar after {reached:.0f} s"
        axes.plot(*zip(*points), "o-", color=f"C{i}", lw=2, label=label)
    if target is not None:
        axes.axhline(target, color="black", ls="--", lw=1.2, label=f"bar {target}")
    for i, (name, value) in enumerate((references or {}).items()):
        axes.axhline(value, ls="--", lw=1.0, color=f"C{len(runs) + i}", alpha=0.6, label=name)
    axes.set_xlabel("seconds since the first step")
    axes.set_ylabel("greedy policy return (eval)")
    axes.legend(loc="lower right")
    axes.grid(alpha=0.3)
    fig.suptitle(title or "evaluation return against time")
    return save(fig, path)


def tool_use_png(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """A tool-using run: the held-out pass rate (sampled and greedy) against wall time; the tool
    calls per episode, the share of calls that failed, and the tokens per episode against steps."""
    fig = figure()
    top, middle, bottom = fig.subplots(3, 1, height_ratios=(2, 1, 1))
    evals = [r for r in rows if r.get("eval_solved") is not None]
    for key, label, color in (("eval_sampled_solved", "held-out pass rate, sampled (T=1)", "tab:green"),
                              ("eval_solved", "held-out pass rate, greedy", "tab:olive")):
        points = [(r["wall_time_s"] / 60, r[key]) for r in evals if r.get(key) is not None]
        if points:
            top.plot(*zip(*points), "o-", color=color, lw=2, label=label)
    top.set_xlabel("minutes since the run started")
    top.set_ylabel("pass rate")
    top.set_ylim(0, 1)
    top.legend(loc="lower right")
    top.grid(alpha=0.3)
    train = [r for r in rows if r.get("tool_calls_per_episode") is not None]
    steps = [r["step"] for r in train]
    calls = [r["tool_calls_per_episode"] for r in train]
    failed = [r.get("tool_errors", 0) / max(1e-9, r["tool_calls_per_episode"] * r["num_games"]) for r in train]
    middle.plot(steps, calls, color="tab:blue", lw=2, label="tool calls per episode")
    middle.plot(steps, failed, color="tab:red", lw=2, label="share of calls that failed")
    middle.legend(loc="center right")
    middle.grid(alpha=0.3)
    bottom.plot(steps, [r["tokens_per_episode"] for r in train], color="tab:purple", lw=2)
    bottom.set_ylabel("tokens per episode")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    if title:
        top.set_title(title)
    return save(fig, path)
