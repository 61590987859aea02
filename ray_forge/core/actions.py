"""Constraining an engine's answers to an env's action words (``policy.constrain_to_actions``).

Pure: takes the model's tokenizer as an argument and returns plain values; the engine turns them
into vLLM's sampling parameters."""

from __future__ import annotations

from ray_forge.config import ConfigError


def action_token_ids(tokenizer, words: tuple[str, ...]) -> list[int] | None:
    """One token per action word: the word bare, or after a space when only that is one token;
    None when neither is, since a one-token restricted sample could not spell it
    (``action_choice`` then).

    One, not both: a word with two tokens splits its probability between them, and a greedy
    answer takes the single likeliest token, so a policy that samples hit 0.6 of the time
    (0.35 + 0.25) answered stick to the 0.4 of the other word; the entropy bonus also counted
    four answers where there are two (SmolLM2 has ``hit``, `` hit``, ``stick`` and `` stick``)."""
    ids = []
    for word in words:
        singles = [t[0] for text in (word, " " + word)
                   if len(t := tokenizer.encode(text, add_special_tokens=False)) == 1]
        if not singles:
            return None
        ids.append(singles[0])
    return sorted(ids)


def action_constraint(tokenizer, words: tuple[str, ...] | None) -> tuple[list[int] | None, tuple[str, ...] | None]:
    """(allowed token ids, action choice) of an engine constrained to ``words``: single-token words
    restrict every sample to their ids, as the trainer's logits are; otherwise a word spans several
    tokens and greedy answers choose among the whole strings. (None, None) without words."""
    if not words:
        return None, None
    allowed_ids = action_token_ids(tokenizer, words)
    return allowed_ids, tuple(words) if allowed_ids is None else None


def constraint_fields(allowed_ids: list[int] | None, choice: tuple[str, ...] | None, greedy: bool,
                      max_tokens: int) -> dict:
    """The constraint's ``SamplingParams`` fields for a completion of up to ``max_tokens``:
    ``allowed_token_ids``, or with ``choice`` the words vLLM's structured outputs choose among
    (``choice``, to wrap in its ``StructuredOutputsParams``) and the budget they need."""
    if choice is not None:
        return action_choice_params(choice, greedy, max_tokens)
    return dict(max_tokens=max_tokens, allowed_token_ids=allowed_ids)


def action_choice_params(words: tuple[str, ...], greedy: bool, max_tokens: int) -> dict:
    """The fields that make the engine answer with exactly one of ``words``, each of which may
    take several tokens: the ``choice`` of vLLM's structured outputs (a grammar over the strings)
    and ``max_tokens``.

    Greedy only: the trainer masks its logits to one fixed set of ids at every position, so it
    cannot reproduce a grammar's per-position mask, and sampled behaviour logprobs would not
    match its own; a training rollout must therefore be unconstrained."""
    if not greedy:
        raise multi_token_actions(words)
    # The grammar may spell a word in any tokenization, one byte per token at worst.
    return dict(choice=list(words), max_tokens=max(max_tokens, _spelling_tokens(words)))


def multi_token_actions(words: tuple[str, ...]) -> ConfigError:
    """The error of a config that constrains sampling to action words that are not single tokens
    (found when the engine starts, or when it is asked to sample)."""
    return ConfigError(f"policy.constrain_to_actions=true needs every action word {list(words)} to be a single "
                       "token of this tokenizer to sample training rollouts (the trainer masks its logits to those "
                       "token ids and cannot reproduce a multi-token constraint); set "
                       "policy.constrain_to_actions=false, policy.draw_from_distribution=false and "
                       f"policy.max_tokens to at least {_spelling_tokens(words)} (evaluation still answers with "
                       "exactly one of them)")


def require_action_words(env_name: str, words: tuple[str, ...] | None) -> None:
    """``policy.constrain_to_actions=true`` is refused for an env that answers in free text: there
    are no action words to constrain to, and sampling unconstrained instead would hide it."""
    if not words:
        raise ConfigError(f"policy.constrain_to_actions=true needs an env with action words; env {env_name!r} has "
                          "none (its answers are free text): set policy.constrain_to_actions=false")


def _spelling_tokens(words: tuple[str, ...]) -> int:
    """Tokens that always suffice to spell any of ``words`` (a byte-level tokenizer needs one per byte)."""
    return max(len(word.encode()) for word in words)
