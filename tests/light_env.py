"""A whole env in one file, the README's "Add your own env" example: say which side the light is on.

Registered by ``tests/test_add_env.py`` and trained for 2 steps by the real job."""

from __future__ import annotations

from dataclasses import dataclass

from ray_forge.core.env import EnvMaker, EnvSpec, StepResult, TextEnv

WORDS = ("LEFT", "RIGHT")


@dataclass(frozen=True, kw_only=True)
class LightOptions:
    """The light env's own settings (``env.options.light``)."""

    reward: float = 1.0
    """Reward of the right side; the wrong one earns 0."""


class LightEnv(TextEnv):
    action_words = WORDS

    def __init__(self, options: LightOptions, invalid_action_penalty: float) -> None:
        self.options, self.penalty, self.side = options, invalid_action_penalty, ""

    def reset(self, seed: int) -> str:
        self.side = WORDS[seed % 2]
        return f"The light is on the {self.side.lower()}. LEFT or RIGHT?"

    def step(self, action_text: str) -> StepResult:
        answer = action_text.strip().upper()
        if answer not in WORDS:
            return StepResult("", self.penalty, True, {"error": "neither LEFT nor RIGHT"})
        return StepResult("", self.options.reward if answer == self.side else 0.0, True)


def evaluate(options: LightOptions, decide, make_env, *, play, invalid_action_penalty: float, final: bool):
    played = play(list(range(8)))  # greedy episodes, played as the rollouts play them
    mean = sum(episode.reward for episode in played) / len(played)
    return {"return": mean}, {"return": mean, "answers": [episode.text for episode in played]}


SPEC = EnvSpec(
    name="light",
    options=LightOptions,
    factory=lambda options, penalty: EnvMaker(lambda: LightEnv(options, penalty)),
    corpus=lambda options: [LightEnv(options, 0.0).reset(seed) for seed in (0, 1)] + list(WORDS),
    probe_prompts=lambda options: [LightEnv(options, 0.0).reset(seed) for seed in (0, 1)],
    evaluate=evaluate,
)
