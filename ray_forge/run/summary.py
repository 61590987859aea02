"""A finished GRPO run's summary: its final evaluation, where every engine ended, how weights
reached them, the env's pictures; written to ``eval.json`` (which marks the run finished)."""

from __future__ import annotations

import json

from ray_forge.actors.launch import Actors
from ray_forge.core.env import EnvSetup
from ray_forge.observe.metrics import METRICS_FILE, read_metrics
from ray_forge.remote import SMALL_CALL_S, get
from ray_forge.run.directory import FINISHED_FILE, Run
from ray_forge.run.recorder import Recorder
from ray_forge.run.fleet import Fleet, FleetError


def summarize(run: Run, env: EnvSetup, actors: Actors, fleet: Fleet, recorder: Recorder, final: dict,
                    final_row: dict) -> dict:
    """The summary of ``final`` (the final evaluation's whole result, ``final_row`` its metrics)."""
    up = fleet.engines_up()  # an engine lost with its node, and not back, is named instead
    if not up:
        raise FleetError(f"no engine is up at the run's end (lost: {', '.join(map(str, sorted(fleet.lost)))})")
    versions = get([fleet.members[name].get_version.remote() for name in up], timeout_s=SMALL_CALL_S,
                   what="policy versions")
    route = get(fleet.members[up[0]].weights_route.remote(), timeout_s=SMALL_CALL_S, what="weights_route", actor=up[0])
    pictures = env.pictures(run.run_dir, read_metrics(run.run_dir / METRICS_FILE), final)
    # The fleet's counters at the end (after settle): a node Ray declared dead after the last step shows here.
    summary = dict(final, **final_row, **fleet.stats(), run_dir=str(run.run_dir), steps=run.config.run.steps, policy_versions=versions,
                   engines_lost=[str(name) for name in sorted(fleet.lost)],
                   weight_transport=actors.store.spec.transport, weight_route=route, tool_tags=actors.tool_tags,
                   pictures=[str(p) for p in pictures],
                   final_weights=f"moving average (trainer.ema_decay {run.config.trainer.ema_decay})"
                   if run.config.trainer.ema_decay else "last step",
                   best_eval_return=recorder.best.get("eval_return"), best_step=recorder.best.get("step"))
    (run.run_dir / FINISHED_FILE).write_text(json.dumps(summary, indent=2))
    return summary
