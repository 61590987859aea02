"""When a thing done now and then during a run is due: one rule for all of them."""

from __future__ import annotations


def every(n: int, step: int, last_step: int | None = None) -> bool:
    """Whether a thing done every ``n`` steps runs after ``step``: at each ``n``-th step and at
    ``last_step`` when given (so ``n`` = 0 means only then, or never)."""
    return step == last_step or (n > 0 and step % n == 0)
