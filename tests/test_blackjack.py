"""BlackJack env rendering, parsing and the exact evaluator against reference values (no Ray)."""

from collections import Counter

import pytest

from envs.blackjack import BlackjackTextEnv, State, evaluate_table, optimal_table, parse_action, render_state
from envs.blackjack.exact import agreement, all_states, initial_states, visit_probabilities
from pictures import CELLS, HIT, STICK, UNREADABLE, assert_drawn


def test_render_shows_the_cards_that_matter():
    text = render_state(State(14, 1, True))
    assert text == "Your sum is 14, soft. Dealer shows A. HIT or STICK?"
    assert "hard" in render_state(State(9, 10, False)) and "10" in render_state(State(9, 10, False))


def test_the_action_words_are_an_option_every_prompt_and_the_evaluation_offer():
    """``env.options.blackjack.words``: a model whose tokenizer splits HIT (SmolLM2's) is asked
    with one-token words; the env, its evaluation and the engine's constraint all use them."""
    from envs.blackjack import BlackjackOptions, SPEC
    from envs.blackjack.policy_eval import evaluate

    options = BlackjackOptions(words=("hit", "stick"))
    env = SPEC.factory(options, -1.0)()
    assert env.action_words == ("hit", "stick")
    assert env.reset(3).endswith(". hit or stick?") and all(p.endswith("hit or stick?") for p in SPEC.probe_prompts(options))
    asked = []
    result = evaluate(lambda prompts: asked.extend(prompts) or ["stick"] * len(prompts), wording=options.wording)
    assert len(asked) == 360 and all(p.endswith(". hit or stick?") for p in asked) and result["hit_states"] == 0
    for words in [("stick", "hit"), ("HIT",), ("go", "stop")]:
        with pytest.raises(ValueError, match="a way to say hit and then one to say stick"):
            BlackjackOptions(words=words)


def test_numbers_as_words_is_an_option_the_env_its_evaluation_and_its_probes_share():
    """``env.options.blackjack.numbers: words``: "fourteen" where digits write "14" (SmolLM2 reads
    10-19 as the token 1 and another), in the prompts the env deals, the evaluation asks and the
    probes send; the 360 states stay 360 distinct prompts."""
    from envs.blackjack import SPEC, BlackjackOptions
    from envs.blackjack.exact import all_states
    from envs.blackjack.policy_eval import evaluate

    options = BlackjackOptions(words=("hit", "stick"), numbers="words")
    assert render_state(State(14, 10, False), options.wording) == "Your sum is fourteen, hard. Dealer shows ten. hit or stick?"
    assert render_state(State(21, 1, True), options.wording) == "Your sum is twenty-one, soft. Dealer shows A. hit or stick?"
    env = SPEC.factory(options, -1.0)()
    first = env.reset(3)
    assert first == render_state(env.state, options.wording) and not any(c.isdigit() for c in first)
    asked = []
    evaluate(lambda prompts: asked.extend(prompts) or ["stick"] * len(prompts), wording=options.wording)
    assert asked == SPEC.probe_prompts(options) == [render_state(s, options.wording) for s in all_states()]
    assert len(set(asked)) == 360 and not any(c.isdigit() for p in asked for c in p)
    assert set(asked) <= set(SPEC.corpus(options))
    with pytest.raises(ValueError, match="numbers = 'roman': it must be one of"):
        BlackjackOptions(numbers="roman")


@pytest.mark.parametrize("text, action", [
    ("HIT", 1), ("stick", 0), (" Stand.", 0), ('"Hit!"', 1), ("hit me", 1), ("\n STICK, please", 0),
    ("\u201cSTICK\u201d", 0), ("HIT, HIT!", 1), ("STICK: standing is safer", 0),
    # An answer that names both actions echoes the question: it is no decision.
    ("HIT or STICK?", None), ("HIT, no STICK", None), ("hit\nstick", None), ("STICK because HIT is risky", None),
    # Only the answer's first word counts: echoes and hedges are invalid, not their first action word.
    ("HIT/STICK", None), (" I will Stand.", None), ("I would not hit, STICK", None),
    (render_state(State(14, 10, False)), None), ("", None), ("hitting", None), ("<unk> <pad>", None)])
def test_an_answer_is_its_first_word_and_none_when_it_hedges_echoes_or_names_both_actions(text, action):
    assert parse_action(text) == action


def test_env_reads_answers_as_parse_action_does():
    env = BlackjackTextEnv(invalid_action_penalty=-2.0)
    env.reset(seed=0)
    hedge = env.step("I would not hit, STICK")
    assert hedge.done and hedge.reward == -2.0 and hedge.info["error"] == "invalid action"
    env.reset(seed=0)
    assert env.step("Stick.").info == {"action": 0}


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


def test_agreement_weights_each_state_by_how_often_optimal_play_reaches_it():
    opt, deals = optimal_table(), initial_states()
    assert sum(deals.values()) == pytest.approx(1.0)
    # Sticking at once reaches only the deals; optimal play reaches a hard 20 by hitting too, but
    # a hard 4 (2 + 2) only by the deal, since a hit adds a card.
    assert visit_probabilities({}) == {s: deals.get(s, 0.0) for s in all_states()}
    visits = visit_probabilities(opt)
    assert visits[State(4, 2, False)] == deals[State(4, 2, False)] > 0
    assert visits[State(20, 10, False)] > deals[State(20, 10, False)]
    assert agreement(opt, opt) == 1.0
    # Always hitting agrees exactly where optimal play hits, weighted by how often it gets there.
    always_hit = {s: 1.0 for s in all_states()}
    hit_share = sum(w for s, w in visits.items() if opt[s] == 1.0) / sum(visits.values())
    assert agreement(always_hit, opt) == pytest.approx(hit_share, abs=1e-12) and 0.0 < hit_share < 0.6


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


def _answers_of(table, invalid=frozenset()):
    """A decide function that answers by ``table``, and "maybe" in the ``invalid`` states."""
    by_prompt = {render_state(s): s for s in all_states()}

    def decide(prompts):
        return ["maybe" if (s := by_prompt[p]) in invalid else "HIT" if table[s] else "STICK" for p in prompts]
    return decide


def test_echoing_model_is_all_invalid_and_worth_the_penalty():
    """Echoing the prompt ("... HIT or STICK?") used to play HIT in every state."""
    from envs.blackjack import evaluate

    result = evaluate(lambda prompts: list(prompts), mc_games=200, invalid_action_penalty=-1.5)
    assert result["invalid_answers"] == 360 and result["invalid_rate"] == 1.0
    assert result["invalid_action_penalty"] == -1.5
    # Every first decision is invalid, so every game ends with the penalty at once.
    assert result["exact_return"] == pytest.approx(-1.5, abs=1e-12)
    assert (result["mc_return"], result["mc_stderr"]) == (-1.5, 0.0)
    assert result["hit_states"] == 0 and result["agreement"] == 0.0
    assert len(result["invalid_states"]) == 360 and set(result["decisions"].values()) == {0}
    assert result["exact_return"] != pytest.approx(evaluate_table({s: 1.0 for s in all_states()}))


def test_unparseable_model_is_worth_the_default_penalty():
    from envs.blackjack import evaluate

    result = evaluate(lambda prompts: ["maybe"] * len(prompts))
    assert result["invalid_rate"] == 1.0 and result["exact_return"] == pytest.approx(-1.0, abs=1e-12)
    assert result["exact_return"] != pytest.approx(evaluate_table({}))  # not valued as STICK


def test_one_invalid_state_costs_its_visit_probability_times_the_lost_value():
    """Only the value at the invalid state changes, and the chance of reaching it does not
    (that depends on earlier decisions only), so the return moves by P(reach) x (penalty - V)."""
    from envs.blackjack import evaluate
    from envs.blackjack.exact import state_values

    opt, state, penalty = optimal_table(), State(16, 10, False), -2.0
    reach, value = visit_probabilities(opt)[state], state_values(lambda s: opt[s])[state]
    assert reach > 0.01 and opt[state] == 1.0
    result = evaluate(_answers_of(opt, {state}), invalid_action_penalty=penalty)
    expected = evaluate_table(opt) + reach * (penalty - value)
    assert result["exact_return"] == pytest.approx(expected, abs=1e-12)
    assert result["invalid_states"] == ["16/10/hard"] and result["invalid_rate"] == 1 / 360
    # An invalid answer never agrees with the optimal one, weighted by how often optimal play reaches it.
    assert result["agreement"] == pytest.approx(1 - reach / sum(visit_probabilities(opt).values()), abs=1e-12)


def test_a_game_ends_at_an_invalid_state():
    always_hit = {s: 1.0 for s in all_states()}
    assert visit_probabilities(always_hit, invalid=all_states()) == {s: initial_states().get(s, 0.0)
                                                                      for s in all_states()}
    assert agreement(optimal_table(), optimal_table(), invalid=all_states()) == 0.0


def test_monte_carlo_agrees_with_exact_when_some_answers_are_invalid():
    """Invalid answers are played through the real env, which ends the game with its penalty."""
    from envs.blackjack import monte_carlo_return

    opt, penalty = optimal_table(), -2.0
    invalid = {s for s in all_states() if not s.usable_ace and 12 <= s.player_sum <= 16 and s.dealer_card >= 7}
    exact = evaluate_table(opt, invalid, penalty)
    mean, sem = monte_carlo_return(opt, 20000, invalid=invalid, penalty=penalty)
    assert abs(mean - exact) < 4 * sem
    # The check can fail: valuing those states as their table action is far off.
    assert abs(mean - evaluate_table(opt)) > 10 * sem


def test_the_decision_table_picture_marks_unreadable_answers(tmp_path):
    """Grey cells framed in red where the answer could not be read; a table whose every answer
    was read has no grey cells."""
    from envs.blackjack.plots import decision_table_png
    from envs.blackjack.policy_eval import evaluate

    result = evaluate(lambda prompts: ["maybe" if "Dealer shows 10" in p else "STICK" for p in prompts])
    assert result["invalid_answers"] == 36  # 18 sums x hard/soft against a dealer's 10
    out = decision_table_png(result["decisions"], tmp_path / "table.png", invalid_states=result["invalid_states"],
                             penalty=result["invalid_action_penalty"])
    assert_drawn(out, areas={STICK: CELLS, HIT: CELLS, UNREADABLE: 2 * CELLS, "red": CELLS})
    read = evaluate(lambda prompts: ["STICK"] * len(prompts))
    clean = decision_table_png(read["decisions"], tmp_path / "clean.png")
    with pytest.raises(AssertionError, match="pixels"):
        assert_drawn(clean, areas={UNREADABLE: 2 * CELLS})


def _outcomes(deal_and_play, num_games: int) -> dict[str, Counter]:
    """What a player sees and gets over ``num_games`` games, played by a state-dependent rule (hit
    below 17, or below 18 on a soft hand): first state's parts, the number of hits, the reward."""
    seen = {"player_sum": Counter(), "dealer_card": Counter(), "soft": Counter(), "hits": Counter(),
            "reward": Counter(), "reward_by_dealer_card": Counter()}
    for first, hits, reward in deal_and_play(num_games):
        seen["player_sum"][first[0]] += 1
        seen["dealer_card"][first[1]] += 1
        seen["soft"][first[2]] += 1
        seen["hits"][min(hits, 3)] += 1
        seen["reward"][reward] += 1
        seen["reward_by_dealer_card"][(first[1], reward)] += 1
    return seen


def _hits(state) -> bool:
    return state[0] < (18 if state[2] else 17)


def _ours(num_games: int):
    envs = [BlackjackTextEnv() for _ in range(num_games)]
    BlackjackTextEnv.reset_all(envs, list(range(num_games)))
    for env in envs:
        first, hits = tuple(env.state), 0
        while True:
            result = env.step("HIT" if _hits(env.state) else "STICK")
            if result.done:
                yield first, hits, result.reward
                break
            hits += 1


def _gymnasium(num_games: int):
    import gymnasium as gym

    env = gym.make("Blackjack-v1", sab=False, natural=False)
    for seed in range(10**6, 10**6 + num_games):
        obs, _ = env.reset(seed=seed)
        first, hits = (int(obs[0]), int(obs[1]), bool(obs[2])), 0
        while True:
            obs, reward, terminated, truncated, _ = env.step(int(_hits(obs)))
            if terminated or truncated:
                yield first, hits, float(reward)
                break
            hits += 1


def _homogeneous(a: Counter, b: Counter) -> float:
    """p-value of a chi-square test that two samples come from one distribution (cells with fewer
    than 10 games in all pooled into one)."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b), key=repr)
    big = [k for k in keys if a[k] + b[k] >= 10]
    rest = [k for k in keys if a[k] + b[k] < 10]
    columns = [(a[k], b[k]) for k in big] + ([(sum(a[k] for k in rest), sum(b[k] for k in rest))] if rest else [])
    return chi2_contingency(list(zip(*columns))).pvalue


def test_the_cards_and_outcomes_are_distributed_as_gymnasium_blackjack_v1s():
    """The env deals its own cards (``envs.blackjack.cards``); gymnasium's Blackjack-v1, played by
    the same rule in this test, must be indistinguishable from it: the first state, the number of
    hits and the reward (overall and by the dealer's card)."""
    ours, theirs = _outcomes(_ours, 40_000), _outcomes(_gymnasium, 40_000)
    for name in ours:
        assert _homogeneous(ours[name], theirs[name]) > 1e-4, (name, ours[name], theirs[name])
    assert set(ours["player_sum"]) == set(range(4, 22)) and set(ours["dealer_card"]) == set(range(1, 11))


def test_the_homogeneity_check_tells_a_deck_without_face_cards_apart():
    """The check above can fail: the same games dealt from a deck whose 10s are a quarter as
    likely (no face cards) are told apart from gymnasium's."""
    import numpy as np

    from envs.blackjack import cards

    no_faces = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 2, 3, 4], dtype=np.int64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cards, "RANKS", no_faces)
        ours = _outcomes(_ours, 40_000)
    theirs = _outcomes(_gymnasium, 40_000)
    assert _homogeneous(ours["reward"], theirs["reward"]) < 1e-6
    assert _homogeneous(ours["player_sum"], theirs["player_sum"]) < 1e-6


def test_a_batch_deals_each_game_the_cards_of_its_seed_and_long_games_draw_on():
    from envs.blackjack.cards import CARDS_DEALT, deal

    batch = [BlackjackTextEnv() for _ in range(3)]
    prompts = BlackjackTextEnv.reset_all(batch, [5, 6, 7])
    assert prompts == [BlackjackTextEnv().reset(seed) for seed in (5, 6, 7)]
    # Card k of a seed does not depend on where the deal starts: a long game draws on the same stream.
    assert (deal([5], 0, 2 * CARDS_DEALT)[0, CARDS_DEALT:] == deal([5], CARDS_DEALT, CARDS_DEALT)[0]).all()
    # A game dealt only its four first cards plays every seed as one dealt the usual dozen.
    for seed in range(300):
        whole, short = BlackjackTextEnv(), BlackjackTextEnv()
        whole.reset(seed)
        short._start(seed, deal([seed], 0, 4)[0].tolist())
        for action in ("HIT", "HIT", "STICK"):
            a, b = whole.step(action), short.step(action)
            assert (a, whole.state) == (b, short.state)
            if a.done:
                break
