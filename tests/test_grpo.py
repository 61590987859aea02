"""GRPO maths against hand-computed values (no Ray)."""

import math

import pytest
import torch

from ray_forge.core.algorithm import group_advantages, grpo_loss, k3_kl, token_logprobs_and_entropy
from ray_forge.core.episode import Episode, Sample, Turn, episodes_to_samples, merge_identical


def test_group_advantages_normalise_within_groups_and_drop_flat_groups():
    rewards = torch.tensor([1.0, -1.0, 0.0, 0.0, 1.0, 1.0])
    adv, keep = group_advantages(rewards, group_size=2)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0]), atol=1e-5)
    assert keep.tolist() == [True, True, False, False, False, False]


def test_group_advantages_three_way():
    # mean 0, population std sqrt(2/3)
    adv, keep = group_advantages(torch.tensor([1.0, 0.0, -1.0]), group_size=3)
    s = math.sqrt(2 / 3)
    assert torch.allclose(adv, torch.tensor([1 / s, 0.0, -1 / s]), atol=1e-5)
    assert keep.all()


def test_group_advantages_scaled_by_the_batch_or_not_at_all_keep_each_groups_gap():
    # Group 1 differs by 2 (a win against a loss), group 2 by 0.2; group 3 is flat.
    rewards = torch.tensor([1.0, -1.0, 0.1, -0.1, 0.5, 0.5])
    by_group, _ = group_advantages(rewards, group_size=2)
    assert torch.allclose(by_group[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)  # the gap is lost
    none, keep = group_advantages(rewards, group_size=2, scale="none")
    assert torch.allclose(none, torch.tensor([1.0, -1.0, 0.1, -0.1, 0.0, 0.0]), atol=1e-6)
    batch_std = rewards.std(correction=0)
    batch, keep_b = group_advantages(rewards, group_size=2, scale="batch")
    assert torch.allclose(batch, none / batch_std, atol=1e-5)
    assert keep.tolist() == keep_b.tolist() == [True, True, True, True, False, False]
    with pytest.raises(ValueError, match="scale must be one of"):
        group_advantages(rewards, group_size=2, scale="max")


def test_group_advantages_rejects_partial_group():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_k3_kl_hand_values():
    lp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    # r = ref/pi = 0.5: k3 = 0.5 - ln 0.5 - 1
    assert torch.allclose(k3_kl(lp, ref), torch.tensor([0.5 - math.log(0.5) - 1]), atol=1e-6)
    assert k3_kl(lp, lp).item() == 0.0


def test_loss_ratio_and_clipping_hand_values():
    # Two sequences, one token each. Behaviour logprob log(0.5).
    # seq 0: new prob 0.8 -> ratio 1.6, A=+1 -> clipped at 1.2 -> loss term -1.2
    # seq 1: new prob 0.8 -> ratio 1.6, A=-1 -> min(-1.6, -1.2) = -1.6 -> term +1.6
    lp = torch.log(torch.tensor([[0.8], [0.8]]))
    blp = torch.log(torch.tensor([[0.5], [0.5]]))
    terms = grpo_loss(lp, blp, torch.tensor([1.0, -1.0]), torch.ones(2, 1), clip_eps=0.2)
    assert terms.loss.item() == pytest.approx((-1.2 + 1.6) / 2, abs=1e-6)
    assert terms.clip_fraction.item() == pytest.approx(0.5)
    assert terms.ratio_mean.item() == pytest.approx(1.6)


def test_the_loss_s_parts_by_hand():
    from ray_forge.core.algorithm import clip_sides, importance_ratios, policy_coefficients, token_means

    lp, blp = torch.log(torch.tensor([[0.5, 0.2]])), torch.log(torch.tensor([[0.25, 0.4]]))
    ratio, tis = importance_ratios(lp, blp, tis_cap=0.0)  # pi / pi_behaviour, weight 1
    assert ratio[0].tolist() == pytest.approx([2.0, 0.5]) and tis.tolist() == [[1.0, 1.0]]
    ratio, tis = importance_ratios(lp, blp, tis_cap=1.5)  # pi / pi_old = 1; min(pi_old / pi_behaviour, 1.5)
    assert ratio.tolist() == [[1.0, 1.0]] and tis[0].tolist() == pytest.approx([1.5, 0.5])
    # A = -1: ratio 2 -> -2 against -1.2 clipped (the unclipped side is the minimum, it keeps its
    # gradient); ratio 0.5 -> -0.5 against -0.8 (the clipped side is, the gradient is gone).
    unclipped, clipped = clip_sides(torch.tensor([[2.0, 0.5]]), torch.tensor([-1.0]), clip_eps=0.2)
    assert unclipped.tolist() == [[-2.0, -0.5]] and clipped[0].tolist() == pytest.approx([-1.2, -0.8])
    ones = torch.ones(1, 2)
    assert policy_coefficients(unclipped, clipped, ones, ones, "token-mean").tolist() == [[-2.0, 0.0]]
    assert policy_coefficients(unclipped, clipped, ones, ones, "seq-mean-token-mean").tolist() == [[-1.0, 0.0]]
    # (1 x 1 + 4 x 2 + 9 x 0 + 2 x 1) / (1 + 2 + 0 + 1)
    means = token_means(torch.tensor([[1.0, 2.0], [0.0, 1.0]]), x=torch.tensor([[1.0, 4.0], [9.0, 2.0]]))
    assert means["x"].item() == pytest.approx(11 / 4)


def test_loss_gradient_is_importance_weighted():
    # Unclipped region: d/dlp of -(exp(lp - blp) * A) = -ratio * A
    lp = torch.log(torch.tensor([[0.55]])).requires_grad_()
    blp = torch.log(torch.tensor([[0.5]]))
    grpo_loss(lp, blp, torch.tensor([2.0]), torch.ones(1, 1), clip_eps=0.2).loss.backward()
    assert lp.grad.item() == pytest.approx(-1.1 * 2.0, rel=1e-5)


def test_logprob_diff_reports_the_engine_trainer_gap():
    lp = torch.log(torch.tensor([[0.5], [0.4]]))
    blp = torch.log(torch.tensor([[0.5], [0.5]]))
    terms = grpo_loss(lp, blp, torch.tensor([1.0, 1.0]), torch.ones(2, 1), clip_eps=0.2)
    assert terms.logprob_diff.item() == pytest.approx(abs(math.log(0.8)) / 2, rel=1e-5)
    assert terms.tis_weight.item() == 1.0  # off by default


def test_truncated_importance_weights_the_gradient_and_is_capped():
    """With tis_cap, each token's policy gradient is -A * min(pi_trainer / pi_engine, cap): the
    engine's numerics weight the update, the clip window is the trainer's own, the cap bounds it."""
    trainer = torch.tensor([[0.5], [0.9], [0.6]])
    engine = torch.tensor([[1.0], [0.3], [0.5]])  # trainer/engine: 0.5, 3.0 (capped to 2), 1.2
    lp = torch.log(trainer).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 2.0])
    terms = grpo_loss(lp, torch.log(engine), adv, torch.ones(3, 1), clip_eps=0.2, tis_cap=2.0)
    weights = torch.tensor([0.5, 2.0, 1.2])
    terms.loss.backward()
    assert torch.allclose(lp.grad.flatten(), -adv * weights / 3, atol=1e-6)
    assert terms.loss.item() == pytest.approx(float(-(adv * weights).mean()), abs=1e-6)
    assert terms.tis_weight.item() == pytest.approx(float(weights.mean()), rel=1e-6)
    assert terms.ratio_mean.item() == pytest.approx(1.0) and terms.clip_fraction.item() == 0.0


def test_truncated_importance_is_the_plain_loss_when_engine_and_trainer_agree():
    lp = torch.log(torch.tensor([[0.3, 0.6]])).requires_grad_()
    adv, mask = torch.tensor([1.5]), torch.ones(1, 2)
    with_tis = grpo_loss(lp, lp.detach(), adv, mask, clip_eps=0.2, tis_cap=2.0)
    plain = grpo_loss(lp, lp.detach(), adv, mask, clip_eps=0.2)
    grad_tis, = torch.autograd.grad(with_tis.loss, lp)
    grad_plain, = torch.autograd.grad(plain.loss, lp)
    assert with_tis.loss.item() == pytest.approx(plain.loss.item()) and torch.equal(grad_tis, grad_plain)


def test_token_mean_weighs_tokens_alike_and_the_seq_means_weigh_sequences_alike():
    # seq 0 has 2 tokens, seq 1 has 1 token and a masked pad; on-policy (ratio 1), A = [1, 3].
    lp = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, 3.0])
    padded = lp.clone()
    padded[1, 1] = 5.0  # a ratio of e^5 at the pad, which no aggregation may read
    per = dict(
        **{"token-mean": -(1 + 1 + 3) / 3},
        **{"seq-mean-token-sum": -(2 + 3) / 2},
        **{"seq-mean-token-mean": -(1 + 3) / 2},
    )
    for mode, expected in per.items():
        for logprobs in (lp, padded):
            got = grpo_loss(logprobs, lp, adv, mask, clip_eps=0.2, aggregation=mode).loss.item()
            assert got == pytest.approx(expected), mode


def test_kl_and_entropy_terms():
    lp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    ent = torch.tensor([[0.7]])
    terms = grpo_loss(lp, lp, torch.tensor([0.0]), torch.ones(1, 1), clip_eps=0.2,
                      ref_logprobs_BT=ref, kl_coef=0.1, entropy_BT=ent, entropy_coef=0.01)
    kl = 0.5 - math.log(0.5) - 1
    assert terms.loss.item() == pytest.approx(0.1 * kl - 0.01 * 0.7, abs=1e-6)
    assert terms.kl.item() == pytest.approx(kl, abs=1e-6)


def test_restricted_logprobs_renormalise_over_allowed_tokens():
    logits = torch.tensor([[[0.0, math.log(3.0), 5.0]]])  # token 2 is excluded
    lp, ent = token_logprobs_and_entropy(logits, torch.tensor([[1]]), allowed_ids=torch.tensor([0, 1]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)


def _sample(tokens, adv, version=0):
    return Sample.completion(tokens[:2], tokens[2:], behaviour_logprobs=(-0.7,), advantage=adv, policy_version=version)


def test_merge_identical_keeps_loss_and_gradient_exact():
    samples = [_sample((1, 2, 3), 0.5), _sample((1, 2, 3), 1.5), _sample((1, 2, 3), -2.0),
               _sample((1, 2, 4), 1.0), _sample((1, 2, 3), 0.7, version=1)]
    merged = merge_identical(samples)
    assert len(merged) == 4
    assert sorted((m.token_ids, m.advantage, m.weight) for m in merged if m.policy_version == 0) == [
        ((1, 2, 3), -2.0, 1.0), ((1, 2, 3), 2.0, 2.0), ((1, 2, 4), 1.0, 1.0)]

    def loss_and_grad(rows):
        logit = torch.tensor(0.3, requires_grad=True)
        lp = torch.stack([logit * (1 + r.token_ids[-1]) - 1.0 for r in rows])[:, None]
        blp = torch.tensor([[r.behaviour_logprobs[0]] for r in rows])
        ent = (lp.exp() * 0.1)
        terms = grpo_loss(lp, blp, torch.tensor([r.advantage for r in rows]), torch.ones(len(rows), 1),
                          clip_eps=0.2, weights_B=torch.tensor([r.weight for r in rows]),
                          entropy_BT=ent, entropy_coef=0.05, ref_logprobs_BT=blp, kl_coef=0.1)
        terms.loss.backward()
        return terms.loss.item(), logit.grad.item()

    full = loss_and_grad(samples)
    assert loss_and_grad(merged) == pytest.approx(full, rel=1e-6)
    assert full[1] != 0.0


def test_episodes_to_samples_credit_every_turn_with_the_game_advantage():
    turns = (Turn((1, 2), (7,), (-0.1,), 3), Turn((1, 5), (8,), (-0.2,), 4))
    ep = Episode(group_id=0, seed=1, turns=turns, reward=1.0)
    assert ep.policy_version == 3
    samples = episodes_to_samples([ep], [0.5])
    assert [(s.token_ids, s.loss_mask, s.advantage, s.policy_version) for s in samples] == [
        ((1, 2, 7), (0, 0, 1), 0.5, 3), ((1, 5, 8), (0, 0, 1), 0.5, 4)]


def test_logprobs_follow_the_sampling_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    lp, _ = token_logprobs_and_entropy(logits, torch.tensor([[1]]), temperature=2.0)
    # softmax([0, ln3]/2) = [1, sqrt 3] / (1 + sqrt 3)
    assert lp.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)


def test_an_episode_pickled_before_its_newer_fields_loads_with_their_defaults():
    """A checkpoint's buffer written by an older version holds episodes without segments, stats,
    tool latencies or messages; resumed, they train as their turns did."""
    import pickle

    episode = Episode(group_id=0, seed=1, turns=(Turn((1, 2), (7,), (-0.1,), 3),), reward=1.0)
    state = {k: v for k, v in episode.__dict__.items() if k in ("group_id", "seed", "turns", "reward", "error")}
    old = Episode.__new__(Episode)
    old.__setstate__(dict(state))  # what unpickling an older episode does
    assert old.segments == () and old.stats == {} and old.tool_latencies_s == () and old.messages == ()
    assert [s.token_ids for s in episodes_to_samples([old], [0.5])] == [(1, 2, 7)]
    assert pickle.loads(pickle.dumps(old)) == old


def test_sampled_logprobs_run_each_distinct_row_once_and_the_head_only_where_a_row_reads():
    """Rows that share an input run once, and the head sees only the positions some row's mask
    reads; each row gets the logprobs and entropies, and the parameters the gradient, that a
    full forward of every row gives."""
    from ray_forge.core.algorithm import token_logprobs_and_entropy
    from ray_forge.core.batch import sampled_logprobs

    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 5)
    seen = []

    def body(inputs_BT):
        return torch.tanh(embed(inputs_BT).cumsum(1))

    def forward_at(inputs_DT, rows_DT):
        seen.append((len(inputs_DT), int(rows_DT.sum())))
        return head(body(inputs_DT)[rows_DT])

    inputs = torch.tensor([[1, 2, 3], [4, 5, 0], [1, 2, 3], [1, 2, 3], [4, 5, 6]])
    targets = torch.tensor([[2, 3, 1], [0, 2, 0], [2, 3, 4], [2, 3, 1], [1, 4, 2]])
    mask = torch.tensor([[0, 0, 1], [0, 1, 0], [0, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.float32)
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5])  # rows alike in input, unlike in target, mask and weight
    allowed = torch.tensor([0, 1, 2, 3, 4])

    def loss_and_grads(logprobs, entropy):
        loss = ((logprobs + 0.1 * entropy) * mask).sum(1).mul(weights).sum()
        loss.backward()
        grads = [p.grad.clone() for p in (*embed.parameters(), *head.parameters())]
        for p in (*embed.parameters(), *head.parameters()):
            p.grad = None
        return loss.item(), grads

    full = token_logprobs_and_entropy(head(body(inputs)), targets, allowed, 0.7)
    full = tuple(torch.where(mask > 0, t, torch.zeros_like(t)) for t in full)
    shared = sampled_logprobs(forward_at, inputs, targets, mask, allowed, 0.7)
    assert seen == [(3, 6)]  # three distinct rows, run once each; the head at 6 of their 9 positions
    for a, b in zip(full, shared):
        torch.testing.assert_close(b, a)
    (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(*full), loss_and_grads(*shared)
    assert loss_b == pytest.approx(loss_a, rel=1e-6) and any(g.abs().sum() > 0 for g in grads_a)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a)
    nothing = sampled_logprobs(forward_at, inputs[:1], targets[:1], torch.zeros(1, 3))  # a padding row
    assert seen[-1] == (1, 0) and all(t.abs().sum() == 0 for t in nothing)


def test_keyed_advantages_compare_each_reward_with_the_mean_of_its_key_wherever_it_sits():
    from ray_forge.core.algorithm import keyed_advantages

    rewards = torch.tensor([1.0, 0.0, -1.0, 1.0, 0.5, 0.5])
    keys = torch.tensor([7, 3, 7, 3, 9, 9])  # key 7: {1, -1}, key 3: {0, 1}, key 9: flat
    none, keep = keyed_advantages(rewards, keys, scale="none")
    assert torch.allclose(none, torch.tensor([1.0, -0.5, -1.0, 0.5, 0.0, 0.0]), atol=1e-6)
    assert keep.tolist() == [True, True, True, True, False, False]
    by_key, _ = keyed_advantages(rewards, keys, scale="group")
    assert torch.allclose(by_key[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)
    same, same_keep = group_advantages(torch.tensor([1.0, -1.0, 0.0, 1.0]), group_size=2, scale="batch")
    keyed, keyed_keep = keyed_advantages(torch.tensor([1.0, -1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), scale="batch")
    assert torch.allclose(same, keyed) and same_keep.tolist() == keyed_keep.tolist()


def test_a_prompt_baseline_credits_each_turn_against_the_turns_of_its_prompt_across_groups():
    """Two groups of two games. State A (prompt 1, 2) is met in every game; state B (prompt 1, 5)
    only in the games of group 0. Group 0's rewards are equal, so the group baseline trains nothing
    from it; the prompt baseline compares its B turns with each other (flat: dropped) and every A
    turn with the mean of all four A turns."""
    from ray_forge.core.batch import groups_to_samples

    def game(group, reward, moves):
        turns = tuple(Turn(prompt, (action,), (-0.5,), 0) for prompt, action in moves)
        return Episode(group_id=group, seed=group, turns=turns, reward=reward)

    a, b = (1, 2), (1, 5)
    groups = [[game(0, 1.0, [(a, 7), (b, 8)]), game(0, 1.0, [(a, 8), (b, 7)])],
              [game(1, -1.0, [(a, 7)]), game(1, 1.0, [(a, 8)])]]
    by_group, group_stats = groups_to_samples(groups, merge=False, scale="none")
    assert [(s.token_ids, s.advantage) for s in by_group] == [(a + (7,), -1.0), (a + (8,), 1.0)]
    assert group_stats["groups_kept"] == 0.5
    by_prompt, stats = groups_to_samples(groups, merge=False, scale="none", baseline="prompt")
    assert [(s.token_ids, s.advantage) for s in by_prompt] == [(a + (7,), 0.5), (a + (8,), 0.5),
                                                                (a + (7,), -1.5), (a + (8,), 0.5)]
    assert stats["turns_kept"] == pytest.approx(4 / 6) and stats["distinct_prompts"] == 2
    with pytest.raises(ValueError, match="baseline must be"):
        groups_to_samples(groups, merge=False, baseline="deal")


def test_inputs_together_puts_rows_of_one_input_side_by_side_and_keeps_each_row():
    from ray_forge.core.batch import inputs_together

    rows = [Sample.completion((1, 2 + i % 3), (5 + i % 2,), behaviour_logprobs=(-0.7,), advantage=float(i),
                              policy_version=0) for i in range(12)]
    ordered = inputs_together(rows)
    inputs = [s.token_ids[:-1] for s in ordered]
    assert sorted(s.advantage for s in ordered) == [float(i) for i in range(12)]
    runs = sum(a != b for a, b in zip([None, *inputs], inputs))  # stretches of one input
    assert runs == len(set(inputs)) == 3


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_center_actions_leaves_each_decision_its_logit_gradient_minus_the_batch_mean(aggregation):
    """With ``actions``, grpo_loss's gradient on each decision's action logits is the plain one
    minus the decisions' mean policy-term gradient (so the policy term's sums to zero over them: no
    step moves every state's answer the same way). The entropy bonus is left whole: centred, it
    would pull a table's minority answers toward the majority's instead of keeping each state
    unsure. The step's statistics are the same."""
    from ray_forge.core.batch import sampled_logprobs

    torch.manual_seed(0)
    allowed = torch.tensor([1, 3])
    logits = torch.randn(4, 2, 5, requires_grad=True)  # four rows of up to two decisions (rows already distinct)
    inputs = torch.arange(8).view(4, 2)
    targets = torch.tensor([[1, 3], [3, 1], [1, 1], [1, 3]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    advantages = torch.tensor([0.5, -1.0, 2.0, -0.3])

    def logit_grads(center: bool, entropy_coef: float):
        logprobs, entropy, actions = sampled_logprobs(lambda inputs, rows: logits[rows], inputs,
                                                      targets, mask, allowed, 1.0, with_actions=True)
        terms = grpo_loss(logprobs, logprobs.detach(), advantages, mask, clip_eps=0.2, aggregation=aggregation,
                          entropy_BT=entropy, entropy_coef=entropy_coef, actions=actions if center else None)
        logits.grad = None
        terms.loss.backward()
        return terms, logits.grad[mask > 0][:, allowed].clone()

    plain_terms, plain = logit_grads(False, 0.0)
    centred_terms, centred = logit_grads(True, 0.0)
    assert plain.sum(0).abs().max() > 1e-3  # the plain gradient has a shared part to remove
    torch.testing.assert_close(centred, plain - plain.mean(0))
    torch.testing.assert_close(centred.sum(0), torch.zeros(2), atol=1e-7, rtol=0)
    for name in ("clip_fraction", "entropy", "ratio_mean"):
        assert getattr(centred_terms, name) == getattr(plain_terms, name)
    _, with_entropy = logit_grads(False, 0.3)
    _, centred_with_entropy = logit_grads(True, 0.3)
    assert (with_entropy - plain).sum(0).abs().max() > 1e-3  # the bonus has a shared part, and keeps it
    torch.testing.assert_close(centred_with_entropy, with_entropy - plain.mean(0))
    with pytest.raises(ValueError, match="with_actions needs allowed_ids"):
        sampled_logprobs(lambda inputs, rows: logits[rows], inputs, targets, mask, with_actions=True)
