"""What a run that lost an engine for good must show, whatever lost it (its node, or a kill with no
restarts left): the steps after the loss at the pace of those before, and no weight version that
waited for the lost engine."""

import statistics

from ray_forge.weights.nixl import REF_GRACE_S


def paced_after_the_loss(rows: list[dict], before: list[dict], log: str) -> None:
    """``rows``: the run's metrics rows; ``before``: those of the steps before the loss."""
    after = rows[len(before):]
    pace, paces = statistics.median(r["step_time_s"] for r in before), [round(r["step_time_s"], 2) for r in after]
    print(f"steps before the loss: median {pace:.2f}s; after: {paces}")  # shown by pytest -rP
    assert after and statistics.median(r["step_time_s"] for r in after) <= 3 * pace, (pace, paces)
    # A sender that waits for a held buffer waits REF_GRACE_S at least, and says so.
    assert max(r["weight_publish_s"] for r in after) < REF_GRACE_S, [r["weight_publish_s"] for r in rows]
    assert "spare buffer" not in log and "still referenced" not in log
