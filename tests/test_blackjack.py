"""BlackJack env rendering, parsing and the exact evaluator against reference values (no Ray)."""

import pytest

from envs.blackjack import BlackjackTextEnv, State, evaluate_table, optimal_table, parse_action, render_state
from envs.blackjack.exact import agreement, all_states, initial_states, visit_probabilities


def test_render_shows_the_cards_that_matter():
    text = render_state(State(14, 1, True))
    assert text == "Your sum is 14, soft. Dealer shows A. HIT or STICK?"
    assert "hard" in render_state(State(9, 10, False)) and "10" in render_state(State(9, 10, False))


@pytest.mark.parametrize("text, action", [("HIT", 1), ("stick", 0), (" I will Stand.", 0), ("hit me", 1),
                                          ("STICK because HIT is risky", 0), ("", None), ("hitting", None),
                                          ("<unk> <pad>", None)])
def test_parse_action(text, action):
    assert parse_action(text) == action


def test_same_seed_deals_the_same_cards():
    a, b = BlackjackTextEnv(), BlackjackTextEnv()
    assert a.reset(seed=123) == b.reset(seed=123)
    ra, rb = a.step("STICK"), b.step("STICK")
    assert (ra.reward, ra.done) == (rb.reward, rb.done)
    prompts = {BlackjackTextEnv().reset(seed=s) for s in range(50)}
    assert len(prompts) > 10  # different seeds, different deals


def test_invalid_action_ends_the_game_with_the_penalty():
    env = BlackjackTextEnv(invalid_action_penalty=-2.0)
    env.reset(seed=0)
    result = env.step("banana")
    assert result.done and result.reward == -2.0 and result.info["error"] == "invalid action"
    env.reset(seed=0)  # the env is still usable
    assert env.step("STICK").done


def test_hit_continues_until_bust_or_stick():
    env = BlackjackTextEnv()
    env.reset(seed=7)
    for _ in range(12):
        result = env.step("HIT")
        if result.done:
            assert result.reward == -1.0
            return
        assert result.observation.startswith("Your sum is")
    pytest.fail("hitting 12 times never busted")


def test_exact_returns_match_reference_values():
    # ../shared/STACK.md: optimal -0.04656, always-stick -0.18637, uniform random -0.39590.
    assert evaluate_table(optimal_table()) == pytest.approx(-0.04656, abs=5e-6)
    assert evaluate_table({}) == pytest.approx(-0.18637, abs=5e-6)
    assert evaluate_table({s: 0.5 for s in all_states()}) == pytest.approx(-0.39590, abs=5e-6)
    blind = {s: float(s.player_sum < (18 if s.usable_ace else 15)) for s in all_states()}
    assert evaluate_table(blind) == pytest.approx(-0.0640, abs=5e-5)


def test_optimal_strategy_matches_the_known_chart():
    opt = optimal_table()
    sticks = {s for s, h in opt.items() if h == 0.0}
    assert State(12, 4, False) in sticks and State(12, 3, False) not in sticks
    assert State(13, 2, False) in sticks and State(16, 10, False) not in sticks
    assert State(17, 1, False) in sticks and State(18, 9, True) not in sticks
    assert State(18, 8, True) in sticks and State(19, 10, True) in sticks


def test_visits_and_agreement():
    opt = optimal_table()
    assert sum(initial_states().values()) == pytest.approx(1.0)
    assert agreement(opt, opt) == 1.0
    always_hit = {s: 1.0 for s in all_states()}
    assert 0.0 < agreement(always_hit, opt) < 0.6
    visits = visit_probabilities(opt)
    assert visits[State(20, 10, False)] > visits[State(4, 2, False)] > 0


def test_exact_value_agrees_with_monte_carlo():
    import numpy as np

    opt = optimal_table()
    env = BlackjackTextEnv()
    rewards = []
    for seed in range(20000):
        env.reset(seed)
        while True:
            result = env.step("HIT" if opt[env.state] else "STICK")
            if result.done:
                rewards.append(result.reward)
                break
    mean, sem = np.mean(rewards), np.std(rewards) / np.sqrt(len(rewards))
    assert abs(mean - evaluate_table(opt)) < 4 * sem
