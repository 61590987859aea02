"""An env whose evaluation never ends, and kills the trainer first: the run must stop on the
trainer's death while the driver waits for the evaluation (``test_chaos``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from light_env import LightEnv, LightOptions, WORDS
from ray_forge.core.env import EnvMaker, EnvSpec


@dataclass(frozen=True, kw_only=True)
class StalledOptions:
    hang_s: float = 600.0
    killed_at: str = ""
    """A file the evaluation writes the time of the kill to."""


def evaluate(options: StalledOptions, decide, make_env, *, play, invalid_action_penalty: float, final: bool):
    import ray

    ray.kill(ray.get_actor("trainer-0"), no_restart=True)  # in the run's namespace: this actor's own
    if options.killed_at:
        with open(options.killed_at, "w") as out:
            out.write(str(time.time()))
    time.sleep(options.hang_s)
    return {"return": 0.0}, {}


SPEC = EnvSpec(
    name="stalled_eval",
    options=StalledOptions,
    factory=lambda options, penalty: EnvMaker(lambda: LightEnv(LightOptions(), penalty)),
    corpus=lambda options: [LightEnv(LightOptions(), 0.0).reset(seed) for seed in (0, 1)] + list(WORDS),
    probe_prompts=lambda options: [LightEnv(LightOptions(), 0.0).reset(seed) for seed in (0, 1)],
    evaluate=evaluate,
)
