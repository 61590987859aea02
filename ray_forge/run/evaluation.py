"""Greedy evaluation through the env pool: every task once, scored exactly as in training (the
env actor plays the games itself, as a rollout worker does).

Takes actor handles as parameters, so a test can drive it with plain objects wrapped in Ray.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Protocol

from ray_forge.actors.rollout import RolloutSettings
from ray_forge.remote import call

EVAL_KEY = -1
"""Env-pool batch key of evaluations. The rollout loop's keys count up from 0, so an evaluation
running while it plays never shares (or releases) one of its batches."""


class TaskLike(Protocol):
    id: str
    kind: str


async def greedy_pass_rate(policy, env_pool, tasks: list[TaskLike], settings: RolloutSettings) -> dict:
    """The policy's greedy completion for each task, scored by ``env_pool`` (seed ``i`` shows task ``i``).

    Returns ``return`` (mean reward) and ``solved`` (fraction of tasks with reward 1), the same
    per task kind (``code_return``, ``math_solved``, ...), the count of each error the env reported,
    and ``tasks``: one row per task with its reward, error and completion.
    """
    # Ahead of the rollouts' requests: the training loop waits for this evaluation.
    settings = dataclasses.replace(settings, group_size=1, greedy=True, priority=-1)
    groups = await call(env_pool.play.remote(policy, "policy-0", [(i, i) for i in range(len(tasks))], settings,
                                             EVAL_KEY), timeout_s=settings.play_limit_s, what="env-0.play")
    rows = [dict(id=task.id, kind=task.kind, reward=episode.reward, error=episode.error,
                 completion="".join(turn.text for turn in episode.turns))
            for task, (episode,) in zip(tasks, groups, strict=True)]
    summary = {}
    for kind in [None, *sorted({row["kind"] for row in rows})]:
        chosen = [row for row in rows if kind in (None, row["kind"])]
        prefix = f"{kind}_" if kind else ""
        summary[f"{prefix}return"] = sum(row["reward"] for row in chosen) / len(chosen)
        summary[f"{prefix}solved"] = sum(row["reward"] == 1.0 for row in chosen) / len(chosen)
    summary["errors"] = dict(Counter(row["error"] for row in rows if row["error"] is not None))
    return dict(summary, tasks=rows)
