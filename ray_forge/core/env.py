"""The env protocol and the env plugin: small, typed, Gymnasium-shaped, for multi-turn text envs.

Envs know nothing of Ray or models. An env package exports one ``EnvSpec``; ``envs/registry.py``
holds them by name. The job turns the run's ``env`` section into an ``EnvSetup`` and hands it to
the env pool actors, which build the envs themselves.
"""

from __future__ import annotations

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

    @classmethod
    def reset_all(cls, envs: list[TextEnv], seeds: list[int]) -> list[str | Exception]:
        """``reset`` each env with its seed: each game's first prompt, or the error its reset raised.
        An env that deals a batch cheaper than one game at a time (BlackJack's cards) overrides it."""
        results: list[str | Exception] = []
        for env, seed in zip(envs, seeds, strict=True):
            try:
                results.append(env.reset(seed))
            except Exception as err:  # one game's failure must not end the batch
                results.append(err)
        return results

    def close(self) -> None:
        """Free what the env holds outside this process (a server's session); called at shutdown."""
        return None

    def tools(self) -> list:
        """The tools (``ray_forge.core.tools.Tool``) the model may call in this episode, bound to it
        (a ``python`` tool's interpreter session). Asked once before any ``reset`` too, for the
        tools' schemas, which the chat template lists. Only a ``sequence``
        episode offers them: ``env.episode.mode``."""
        return []


O = TypeVar("O")
Decide = Callable[[list[str]], list[str]]
"""Prompts in, the policy's greedy completions out, in order (an engine, an actor, a function)."""
PlayEpisodes = Callable[..., list[Any]]
"""``play(seeds, greedy=True)``: seeds in, one ``Episode`` per seed out (greedy, or sampled at the
policy's temperature with a seed fixed by the game's), played by the run's own game loop
(``ray_forge.core.play``) on the env actor's envs: the same episodes a rollout plays."""


class EnvMaker:
    """What an env's factory returns: makes one env per call, and ``close`` stops what the envs
    share (a sandbox pool), once, when the env actor shuts down."""

    def __init__(self, make: Callable[[], TextEnv], close: Callable[[], None] | None = None) -> None:
        self._make, self._close = make, close

    def __call__(self) -> TextEnv:
        return self._make()

    def close(self) -> None:
        if self._close is not None:
            self._close()


def _one_thread(options: Any) -> int:
    return 1


def _no_references(options: Any) -> dict[str, float]:
    return {}


def _no_pictures(options: Any, run_dir: Path, rows: list[dict], final: dict) -> list[Path]:
    return []


@dataclass(frozen=True)
class EnvSpec(Generic[O]):
    """Everything the library and the job know of one env. Every callable is Ray-free.

    An env that plays another registered env's games somewhere else (an OpenEnv server) names it
    with ``plays`` instead of giving ``corpus``, ``probe_prompts`` and ``evaluate``: the job then
    uses that env's, with its own options (``env.options.<that name>``)."""

    name: str
    """What ``env.name`` says to choose it."""
    options: type[O]
    """Its own config section, ``env.options.<name>``: a frozen, keyword-only dataclass, every
    field documented; a ``__post_init__`` that raises ValueError is reported under that key."""
    factory: Callable[[O, float], EnvMaker]
    """(options, the run's invalid-action penalty) -> an ``EnvMaker``. Called once in each env
    actor, where the envs live (it may start what they share, such as a sandbox pool)."""
    corpus: Callable[[O], list[str]] | None = None
    """Texts a tiny model's tokenizer is trained on (``model.path`` empty)."""
    probe_prompts: Callable[[O], list[str]] | None = None
    """Prompts on which policy-0 and the trainer are compared after a sync."""
    evaluate: Callable[..., tuple[dict[str, float], dict]] | None = None
    """``evaluate(options, decide, make_env, play=..., invalid_action_penalty=..., final=...)``: the
    greedy policy scored on this env, through ``decide`` (raw prompts to completions) or ``play``
    (seeds to whole episodes, as rollouts play them); ``make_env`` is the env actor's own maker;
    ``final`` is the end-of-run evaluation, which may be longer. Returns its metrics (logged as
    ``eval_<name>``; ``return`` is what ``run.keep_best`` maximises, and must be there) and the
    whole result (the run's ``eval.json``)."""
    pictures: Callable[[O, Path, list[dict], dict], list[Path]] = _no_pictures
    """(options, run directory, metrics rows, final evaluation result) -> the PNGs written at the
    end of a run."""
    concurrency: Callable[[O], int] = _one_thread
    """Games an env actor steps at once, in threads (envs that wait on execution or a server);
    an env whose games call tools gives every game in play a thread of its own."""
    references: Callable[[O], dict[str, float]] = _no_references
    """Returns of known policies (``"optimal policy (exact)": -0.0466``), drawn as lines on plots."""
    plays: Callable[[O], str] | None = None
    """The registered env whose games this one plays elsewhere (its evaluation, texts and pictures
    are used), or None for an env that is its own."""

    def __post_init__(self) -> None:
        own = (self.corpus, self.probe_prompts, self.evaluate)
        if (self.plays is None) != all(f is not None for f in own):
            raise ValueError(f"env spec {self.name!r}: give corpus, probe_prompts and evaluate, or plays")

    @property
    def key(self) -> str:
        """Where its options sit in a job config."""
        return f"env.options.{self.name}"

    def setup(self, options: dict) -> EnvSetup:
        """This env with ``options`` (the raw mapping at ``key``), checked like any config section."""
        from ray_forge.config import from_dict

        return EnvSetup(self, from_dict(self.options, options, self.key))


@dataclass(frozen=True)
class EnvSetup:
    """One env as a run uses it: its spec, its checked options and, for an env that plays another's
    games, that env's setup. Ray (cloudpickle) ships it to the env actors, which build their envs
    from it; functions defined in a module travel by reference, lambdas by value."""

    spec: EnvSpec
    options: Any
    played: EnvSetup | None = None

    @property
    def _source(self) -> EnvSetup:
        """Whose evaluation, texts and pictures these are."""
        return self.played or self

    def make_env(self, invalid_action_penalty: float) -> EnvMaker:
        return self.spec.factory(self.options, invalid_action_penalty)

    def corpus(self) -> list[str]:
        return self._source.spec.corpus(self._source.options)

    def probe_prompts(self) -> list[str]:
        return self._source.spec.probe_prompts(self._source.options)

    def concurrency(self) -> int:
        return self.spec.concurrency(self.options)

    def references(self) -> dict[str, float]:
        return self._source.spec.references(self._source.options)

    def evaluate(self, decide: Decide, make_env: EnvMaker, *, play: PlayEpisodes, invalid_action_penalty: float,
                 final: bool) -> tuple[dict[str, float], dict]:
        source = self._source
        metrics, result = source.spec.evaluate(source.options, decide, make_env, play=play,
                                               invalid_action_penalty=invalid_action_penalty, final=final)
        if not isinstance(metrics.get("return"), float):
            raise TypeError(f"env {source.spec.name!r}: its evaluation's metrics must hold a float 'return' "
                            f"(what run.keep_best maximises); it gave {sorted(metrics)}")
        return metrics, result

    def pictures(self, run_dir: Path, rows: list[dict], final: dict) -> list[Path]:
        return self._source.spec.pictures(self._source.options, run_dir, rows, final)
