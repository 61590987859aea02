"""What the GRPO driver (``jobs/grpo.py``) does differently per env: the texts a tiny model's
tokenizer is trained on, the greedy evaluation, and the PNGs a run ends with."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Awaitable, Callable

from envs.blackjack import BlackjackTextEnv, evaluate, render_state
from envs.blackjack.exact import all_states
from envs.blackjack.plots import run_pictures
from envs.code.env import CodeEnv
from envs.code.tasks import BUNDLED, load_tasks
from ray_forge.actors.launch import Actors
from ray_forge.actors.rollout import RolloutSettings
from ray_forge.config import ConfigError
from ray_forge.config.schema import JobConfig
from ray_forge.observe.plots import learning_curve_png
from ray_forge.remote import get
from ray_forge.run.evaluation import greedy_pass_rate


def rollout_settings(config: JobConfig) -> RolloutSettings:
    return RolloutSettings(group_size=config.grpo.group_size, max_turns=config.env.max_turns,
                           invalid_action_penalty=config.env.invalid_action_penalty,
                           policy_timeout_s=config.policy.call_timeout_s, env_timeout_s=config.env.call_timeout_s)


async def blackjack_eval(config: JobConfig, actors: Actors, mc_games: int) -> tuple[dict, dict]:
    """Exact return (and optionally Monte Carlo) of policy-0's greedy decision table; an
    unparseable answer is worth the run's ``env.invalid_action_penalty``, as in training."""
    def decide(prompts: list[str]) -> list[str]:
        # Ahead of the rollouts' requests: the training loop waits for this evaluation.
        return [c.text for c in get(actors.policies[0].generate.remote(prompts, True, None, -1),
                                    timeout_s=config.policy.call_timeout_s, what="policy-0.generate")]
    result = await asyncio.get_running_loop().run_in_executor(
        None, lambda: evaluate(decide, mc_games=mc_games, invalid_action_penalty=config.env.invalid_action_penalty))
    return result, dict(eval_return=result["exact_return"], eval_agreement=result["agreement"],
                        eval_invalid_rate=result["invalid_rate"])


async def code_eval(config: JobConfig, actors: Actors, mc_games: int) -> tuple[dict, dict]:
    """Greedy pass rate of policy-0 over every task, scored by env-0's sandbox as in training."""
    result = await greedy_pass_rate(actors.policies[0], actors.envs[0], load_tasks(config.env.code.tasks or BUNDLED),
                                    rollout_settings(config))
    return result, {f"eval_{name}": value for name, value in result.items() if isinstance(value, float)}


def code_prompts(config: JobConfig) -> list[str]:
    """Every task's prompt, as the code env shows it."""
    tasks = load_tasks(config.env.code.tasks or BUNDLED)
    env = CodeEnv(tasks, executor=None)
    return [env.reset(i) for i in range(len(tasks))]


def code_corpus(config: JobConfig) -> list[str]:
    """The prompts exactly as the code env shows them (showing one runs nothing), and the tests
    written as Python (``gcd(12, 18) == 6``)."""
    tests = [f"{task.entry_point}({', '.join(map(repr, call.args))}) == {call.expected!r}"
             for task in load_tasks(config.env.code.tasks or BUNDLED) for call in task.tests]
    return code_prompts(config) + tests


@dataclasses.dataclass(frozen=True)
class EnvHooks:
    """What the driver does differently per env."""

    corpus: Callable[[JobConfig], list[str]]
    """Texts the tiny model's tokenizer is trained on (``model.path`` empty)."""
    evaluate: Callable[[JobConfig, Actors, int], Awaitable[tuple[dict, dict]]]
    """Greedy evaluation of policy-0 (with this many Monte-Carlo games where the env has them):
    the full result, and its metrics-row fields (``eval_return`` is what ``keep_best`` maximises)."""
    pictures: Callable[[Path, list[dict], dict], list[Path]]
    """PNGs written at the end of a run, from its metrics rows and final evaluation."""
    probe_prompts: Callable[[JobConfig], list[str]]
    """Prompts on which policy-0 and the trainer are compared after a sync (``run.sync_check_every``)."""


HOOKS = {
    "blackjack": EnvHooks(corpus=lambda config: BlackjackTextEnv.corpus(), evaluate=blackjack_eval,
                          pictures=run_pictures,
                          probe_prompts=lambda config: [render_state(s) for s in all_states()]),
    "code": EnvHooks(corpus=code_corpus, evaluate=code_eval, probe_prompts=code_prompts,
                     pictures=lambda run_dir, rows, final: [
                         learning_curve_png(rows, run_dir / "learning_curve.png", "coding and math tasks")]),
}


def env_hooks(config: JobConfig) -> EnvHooks:
    # An OpenEnv server is evaluated as what it plays.
    name = config.env.openenv.kind if config.env.name == "openenv" else config.env.name
    if name not in HOOKS:
        raise ConfigError(f"jobs/grpo.py has no evaluation for env.name={config.env.name!r} "
                          f"(known: {', '.join(HOOKS)}, openenv)")
    return HOOKS[name]
