"""The sync check's comparison of the engine's answers with the trainer's scores (pure)."""

import pytest

from ray_forge.core.episode import Scored, Turn
from ray_forge.run.sync_check import compare, draw


def _turn(prompt: tuple[int, ...], token: int, logprob: float) -> Turn:
    return Turn(prompt_ids=prompt, response_ids=(token,), logprobs=(logprob,), policy_version=3)


PROMPTS = [(1, 2), (1, 3), (4,)]


def test_one_scoring_of_the_sampled_answers_serves_the_greedy_agreement_too():
    greedy = [_turn(p, token, -0.1) for p, token in zip(PROMPTS, (7, 8, 7))]
    sampled = [_turn(p, token, logprob) for p, token, logprob in zip(PROMPTS, (8, 8, 7), (-0.9, -0.2, -0.5))]
    scored = [Scored((-0.9,), 7), Scored((-0.2005,), 8), Scored((-0.5,), 8)]  # the third prompt's argmax differs
    row = compare(greedy, sampled, scored)
    assert row["sync_greedy_agreement"] == pytest.approx(2 / 3)
    assert row["sync_logprob_max_diff"] == pytest.approx(0.0005)


def test_answers_of_different_prompts_are_refused():
    greedy = [_turn(p, 7, -0.1) for p in PROMPTS]
    sampled = [_turn(p, 7, -0.1) for p in reversed(PROMPTS)]
    with pytest.raises(ValueError, match="same prompts"):
        compare(greedy, sampled, [Scored((-0.1,), 7)] * 3)


def test_a_check_asks_a_fresh_draw_of_the_probes_or_all_of_them():
    probes = [f"state {i}" for i in range(360)]
    first, again, next_check = draw(probes, 64, seed=7), draw(probes, 64, seed=7), draw(probes, 64, seed=8)
    assert len(first) == len(set(first)) == 64 and set(first) <= set(probes)
    assert first == again and first != next_check
    assert first == sorted(first, key=probes.index)  # in the probes' order
    assert draw(probes, 0, seed=7) == probes and draw(probes[:10], 64, seed=7) == probes[:10]
