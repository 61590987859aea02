"""BlackJack as a plugin: its options (``env.options``), the envs it makes, its tokenizer texts,
its exact evaluation and its pictures."""

from __future__ import annotations

from dataclasses import dataclass

from envs.blackjack.env import ACTION_WORDS, BlackjackTextEnv, Wording, render_state
from envs.blackjack.exact import all_states
from envs.blackjack.plots import reference_returns, run_pictures
from envs.blackjack.policy_eval import evaluate as evaluate_policy
from ray_forge.core.env import Decide, EnvMaker, EnvSpec, PlayEpisodes


@dataclass(frozen=True, kw_only=True)
class BlackjackOptions:
    """BlackJack (``env.name: blackjack``): gymnasium Blackjack-v1's rules, the cards shown in each prompt."""

    mc_games: int = 20000
    """Monte-Carlo games in the final evaluation, a cross-check of the exact return (0: none)."""
    words: tuple[str, str] = ACTION_WORDS
    """The action words each prompt offers, hit's then stick's (hit, stick or stand, any case).
    ``policy.constrain_to_actions`` needs each to be one token: SmolLM2's tokenizer splits HIT and
    STICK but not hit and stick."""
    numbers: str = "digits"
    """How prompts write the sums and the dealer's card: digits or words ("14" or "fourteen").
    SmolLM2 reads "14" as the tokens 1 and 4, so sums 10-19 start alike and a gradient that moves
    one moves them all; " fourteen" is one token of its own (docs/benchmarks/2026-12-07-3.md)."""

    def __post_init__(self) -> None:
        if self.mc_games < 0:
            raise ValueError(f"mc_games = {self.mc_games} is out of range: it must be >= 0")
        self.wording  # noqa: B018 -- checks the words and the numbers

    @property
    def wording(self) -> Wording:
        return Wording(tuple(self.words), self.numbers)


def make_envs(options: BlackjackOptions, invalid_action_penalty: float) -> EnvMaker:
    return EnvMaker(lambda: BlackjackTextEnv(invalid_action_penalty=invalid_action_penalty, wording=options.wording))


def evaluate(options: BlackjackOptions, decide: Decide, make_env: EnvMaker, *, play: PlayEpisodes,
             invalid_action_penalty: float, final: bool) -> tuple[dict[str, float], dict]:
    """The exact return of the greedy decision table (and, at the end, a Monte-Carlo cross-check);
    an unreadable answer is worth the run's penalty, as in training. The table asks ``decide``
    each of the 360 states as a game's first turn (``play`` is not needed)."""
    result = evaluate_policy(decide, mc_games=options.mc_games if final else 0,
                             invalid_action_penalty=invalid_action_penalty, wording=options.wording)
    metrics = {"return": result["exact_return"], "agreement": result["agreement"],
               "invalid_rate": result["invalid_rate"]}
    return metrics, result


SPEC = EnvSpec(name="blackjack", options=BlackjackOptions, factory=make_envs,
               corpus=lambda options: BlackjackTextEnv.corpus(options.wording),
               probe_prompts=lambda options: [render_state(s, options.wording) for s in all_states()],
               evaluate=evaluate, pictures=lambda options, run_dir, rows, final: run_pictures(run_dir, rows, final),
               references=lambda options: reference_returns())
