"""The env protocol and the env plugin: small, typed, Gymnasium-shaped, for multi-turn text envs.

Envs know nothing of Ray or models. An env package exports one ``EnvSpec``; ``envs/registry.py``
holds them by name. The job turns the run's ``env`` section into an ``EnvSetup`` and hands it to
the env pool actors, which build the envs themselves.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Protocol, TypeVar


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)
    """``info["error"]`` says why a game ended early (e.g. an unparseable action)."""


class TextEnv(Protocol):
    """One episode at a time: ``reset`` then ``step`` until ``done``. Subclass it to inherit the
    optional ``close``."""

    action_words: tuple[str, ...] | None
    """The valid actions when the action space is a small set of words (enables constrained
    sampling); None for free-form actions such as code."""

    def reset(self, seed: int) -> str:
        """Start an episode; the same seed deals the same episode. Returns the first prompt."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Apply the model's completion. Unparseable text ends the episode with a penalty."""
        ...

    def close(self) -> None:
        """Free what the env holds outside this process (a server's session); called at shutdown."""
        return None


O = TypeVar("O")
Decide = Callable[[list[str]], list[str]]
"""Prompts in, the policy's greedy completions out, in order (an engine, an actor, a function)."""
MakeEnv = Callable[[], TextEnv]


def _one_thread(options: Any) -> int:
    return 1


def _no_references(options: Any) -> dict[str, float]:
    return {}


@dataclass(frozen=True)
class EnvSpec(Generic[O]):
    """Everything the library and the job know of one env. Every callable is Ray-free."""

    name: str
    """What ``env.name`` says to choose it."""
    options: type[O]
    """Its own config section, ``env.options``: a frozen, keyword-only dataclass, every field documented."""
    factory: Callable[[O, float], MakeEnv]
    """(options, the run's invalid-action penalty) -> a maker of envs. Called once in each env
    actor, where the envs live (it may start what they share, such as a sandbox pool)."""
    corpus: Callable[[O], list[str]]
    """Texts a tiny model's tokenizer is trained on (``model.path`` empty)."""
    probe_prompts: Callable[[O], list[str]]
    """Prompts on which policy-0 and the trainer are compared after a sync."""
    evaluate: Callable[..., tuple[dict[str, float], dict]]
    """``evaluate(options, decide, make_env, invalid_action_penalty=..., final=...)``: the greedy
    policy ``decide`` scored on this env (``make_env`` is the env actor's own maker; ``final`` is
    the end-of-run evaluation, which may be longer). Returns its metrics (logged as
    ``eval_<name>``; ``return`` is what ``run.keep_best`` maximises) and the whole result (the
    run's ``eval.json``)."""
    pictures: Callable[[O, Path, list[dict], dict], list[Path]]
    """(options, run directory, metrics rows, final evaluation result) -> the PNGs written at the
    end of a run."""
    concurrency: Callable[[O], int] = _one_thread
    """Games an env actor steps at once, in threads (envs that wait on execution or a server)."""
    references: Callable[[O], dict[str, float]] = _no_references
    """Returns of known policies (``"optimal policy (exact)": -0.0466``), drawn as lines on plots."""

    def setup(self, options: dict, key: str = "env.options") -> EnvSetup:
        """This env with ``options`` (the raw mapping at config ``key``), checked like any config section."""
        from ray_forge.config import from_dict

        return EnvSetup(self, from_dict(self.options, options, key))


@dataclass(frozen=True)
class EnvSetup:
    """One env as a run uses it: its spec and its checked options. Picklable: the env actors
    receive it and build their envs from it."""

    spec: EnvSpec
    options: Any

    def make_env(self, invalid_action_penalty: float) -> MakeEnv:
        return self.spec.factory(self.options, invalid_action_penalty)

    def corpus(self) -> list[str]:
        return self.spec.corpus(self.options)

    def probe_prompts(self) -> list[str]:
        return self.spec.probe_prompts(self.options)

    def concurrency(self) -> int:
        return self.spec.concurrency(self.options)

    def evaluate(self, decide: Decide, make_env: MakeEnv, *, invalid_action_penalty: float,
                 final: bool) -> tuple[dict[str, float], dict]:
        return self.spec.evaluate(self.options, decide, make_env, invalid_action_penalty=invalid_action_penalty,
                                  final=final)

    def references(self) -> dict[str, float]:
        return self.spec.references(self.options)

    def pictures(self, run_dir: Path, rows: list[dict], final: dict) -> list[Path]:
        return self.spec.pictures(self.options, run_dir, rows, final)


def play_greedy(make_env: MakeEnv, decide: Decide, seeds: list[int], *, max_turns: int, penalty: float,
                threads: int = 1) -> list[tuple[float, str | None, str]]:
    """Play one game per seed with ``decide``'s answers, every game's turn in one call of it.
    Returns (reward, error, the completions joined) per game; a game still running after
    ``max_turns``, or whose env raised, ends with ``penalty``."""
    envs = [make_env() for _ in seeds]
    rewards, errors, texts = [0.0] * len(seeds), [None] * len(seeds), [""] * len(seeds)
    live: dict[int, str] = {}
    for i, (env, seed) in enumerate(zip(envs, seeds, strict=True)):
        try:
            live[i] = env.reset(seed)
        except Exception as err:  # one game's failure must not end the evaluation
            rewards[i], errors[i] = penalty, f"env reset error: {err}"
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for _ in range(max_turns):
            if not live:
                break
            slots = list(live)
            answers = decide([live[i] for i in slots])

            def one(i: int, answer: str) -> StepResult:
                try:
                    return envs[i].step(answer)
                except Exception as err:
                    return StepResult("", penalty, True, {"error": f"env error: {err}"})

            for i, answer, result in zip(slots, answers, pool.map(one, slots, answers), strict=True):
                texts[i] += answer
                rewards[i] += result.reward
                if result.done:
                    errors[i] = result.info.get("error")
                    del live[i]
                else:
                    live[i] = result.observation
    for i in live:
        rewards[i], errors[i] = penalty, f"still playing after {max_turns} turns"
    for env in envs:
        env.close()
    return [(rewards[i], errors[i], texts[i]) for i in range(len(seeds))]
