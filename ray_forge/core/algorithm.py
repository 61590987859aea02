"""GRPO maths as pure tensor functions: group advantages, clipped importance-corrected loss, k3 KL.

Shapes: B sequences, T target positions. ``mask_BT`` is 1 on generated (response) tokens.
``weights_B`` counts how many identical samples a row stands for (see ``episode.merge_identical``);
the policy-gradient term carries it through the advantage, KL and entropy through the weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
RewardScale = Literal["group", "batch", "none"]
REWARD_SCALES = get_args(RewardScale)
Baseline = Literal["group", "prompt"]


def group_advantages(rewards_B: torch.Tensor, group_size: int, scale: RewardScale = "group",
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Each reward minus its group's mean (consecutive groups of ``group_size``), divided as
    ``scale`` says: by the group's std ("group": GRPO as published, verl's default), by the whole
    batch's std ("batch") or by nothing ("none", Dr. GRPO); TRL's ``scale_rewards`` has the same three.

    Returns (advantages_B, keep_B). A group whose rewards are all equal carries no signal and is
    dropped (keep=False, advantage 0). Uses the population std so a 2-game group gives +-1.

    Why "group" is not always right: it gives every group a push of the same size whatever the gap
    between its rewards, so the update follows how *often* one answer beats another, not by *how
    much*. Where the games of a group share their randomness (BlackJack's same deal), the two
    differ: on hard 13 against a dealer's 2 or 3, hitting beats sticking more often than the
    reverse, yet sticking has the higher expected return. "batch" keeps one scale for the whole
    step, so the expected update is the policy gradient's.
    """
    if rewards_B.numel() % group_size:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    return keyed_advantages(rewards_B, torch.arange(rewards_B.numel()) // group_size, scale, eps)


def keyed_advantages(rewards_B: torch.Tensor, keys_B: torch.Tensor, scale: RewardScale = "group",
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_advantages`` where a group is every reward with the same key, wherever it sits:
    the baseline of a turn is the mean return of every turn in the batch asked the same prompt.

    With one decision per turn and the state in the prompt (BlackJack's draws) that is a
    per-state baseline, G - V(s), an estimate of Q(s, a) - V(s): a deal's group mean instead
    pushes every decision of a game by the game's luck, which moves the whole table at once."""
    rewards_B = rewards_B.float()
    distinct_N, group_B = torch.unique(keys_B, return_inverse=True)
    count_N = torch.bincount(group_B, minlength=len(distinct_N)).float()
    mean_N = torch.zeros_like(count_N).index_add_(0, group_B, rewards_B) / count_N
    centred_B = rewards_B - mean_N[group_B]
    std_N = (torch.zeros_like(count_N).index_add_(0, group_B, centred_B**2) / count_N).sqrt()
    keep_B = std_N[group_B] > eps
    if scale == "group":
        divisor_B = std_N[group_B] + eps
    elif scale == "batch":
        divisor_B = (rewards_B.std(correction=0) + eps).expand_as(rewards_B)
    elif scale == "none":
        divisor_B = torch.ones_like(rewards_B)
    else:
        raise ValueError(f"scale must be one of {REWARD_SCALES}, got {scale!r}")
    return torch.where(keep_B, centred_B / divisor_B, torch.zeros_like(rewards_B)), keep_B


def k3_kl(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference), per token, always >= 0."""
    log_ratio = ref_logprobs_BT - logprobs_BT
    return torch.exp(log_ratio) - log_ratio - 1.0


def loss_normalizer(mask_BT: torch.Tensor, weights_B: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """The denominator of the aggregated loss, over the *whole* batch (all micro-batches and ranks)."""
    if aggregation == "token-mean":
        return (mask_BT * weights_B[:, None]).sum()
    return weights_B.sum()


def aggregate(values_BT: torch.Tensor, mask_BT: torch.Tensor, aggregation: Aggregation, normalizer: torch.Tensor) -> torch.Tensor:
    """Sum masked per-token values the way ``aggregation`` says, divided by ``normalizer``.

    The values already carry each row's weight, so this is a plain masked sum.
    """
    masked_BT = values_BT * mask_BT
    if aggregation == "seq-mean-token-mean":
        masked_BT = masked_BT / mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
    return masked_BT.sum() / normalizer


@dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor
    clip_fraction: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    ratio_mean: torch.Tensor
    logprob_diff: torch.Tensor
    """Mean |trainer logprob - behaviour logprob| of the tokens: on-policy, the precision gap
    between engine and trainer (0 when both compute alike); off-policy it adds the lag."""
    tis_weight: torch.Tensor
    """Mean truncated importance weight (1 when ``tis_cap`` is off)."""


TOKEN_STATS = ("clip_fraction", "kl", "entropy", "ratio_mean", "logprob_diff", "tis_weight")
"""The token-weighted statistics of :class:`LossTerms` (a step reports their means)."""


def grpo_loss(
    logprobs_BT: torch.Tensor,
    behaviour_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float,
    weights_B: torch.Tensor | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    aggregation: Aggregation = "token-mean",
    normalizer: torch.Tensor | None = None,
    tis_cap: float = 0.0,
    actions: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LossTerms:
    """Clipped policy-ratio loss against the behaviour policy's logprobs (importance-corrected).

    ratio = pi_theta / pi_behaviour per token, where pi_behaviour is what the rollout engine
    reported; samples from older policy versions are therefore corrected, not assumed on-policy.

    With ``tis_cap`` > 0 (truncated importance sampling, as verl and slime do when the engine
    samples in another precision than the trainer computes in): the clipped ratio is taken
    against the trainer's own logprobs before this update (pi_old, detached), and each token's
    term is weighted by min(pi_old / pi_behaviour, tis_cap), detached. The engine's numerics then
    weight the gradient instead of moving the clip window, and the cap bounds its variance.

    With ``actions`` (each read token's logprobs over the action words and a one-hot of the word
    sampled, in ``mask_BT``'s row-major order): the policy term's gradient is centred across the
    tokens (``shared_direction_term``). The entropy bonus is not: centred, it would pull a table's
    minority answers toward the majority's rather than keep each state unsure.
    """
    mask_BT = mask_BT.to(logprobs_BT.dtype)
    if weights_B is None:
        weights_B = torch.ones_like(advantages_B)
    if normalizer is None:
        normalizer = loss_normalizer(mask_BT, weights_B, aggregation)
    ratio_BT, tis_BT = importance_ratios(logprobs_BT, behaviour_logprobs_BT, tis_cap)
    unclipped_BT, clipped_BT = clip_sides(ratio_BT, advantages_B, clip_eps)
    per_token_BT = -torch.minimum(unclipped_BT, clipped_BT) * tis_BT
    centring = torch.zeros((), dtype=logprobs_BT.dtype, device=logprobs_BT.device)
    if actions is not None:
        coef_BT = policy_coefficients(unclipped_BT, clipped_BT, tis_BT, mask_BT, aggregation)
        centring = shared_direction_term(*actions, coef_BT[mask_BT > 0]) / normalizer
    w_B1 = weights_B[:, None]
    kl_BT = torch.zeros_like(logprobs_BT)
    if ref_logprobs_BT is not None:
        kl_BT = k3_kl(logprobs_BT, ref_logprobs_BT)
        per_token_BT = per_token_BT + kl_coef * w_B1 * kl_BT
    ent_BT = entropy_BT if entropy_BT is not None else torch.zeros_like(logprobs_BT)
    if entropy_coef:
        per_token_BT = per_token_BT - entropy_coef * w_B1 * ent_BT
    with torch.no_grad():
        # Tokens where clipping removed the gradient, i.e. the unclipped term was not the minimum.
        is_clipped_BT = (unclipped_BT > clipped_BT).to(mask_BT.dtype)
        stats = token_means(mask_BT * w_B1, clip_fraction=is_clipped_BT, kl=kl_BT, entropy=ent_BT,
                            ratio_mean=ratio_BT, logprob_diff=(logprobs_BT.detach() - behaviour_logprobs_BT).abs(),
                            tis_weight=tis_BT)
    return LossTerms(loss=aggregate(per_token_BT, mask_BT, aggregation, normalizer) + centring, **stats)


def importance_ratios(logprobs_BT: torch.Tensor, behaviour_logprobs_BT: torch.Tensor,
                      tis_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio_BT, tis_BT): the policy ratio the clip applies to and each token's truncated
    importance weight. Without ``tis_cap``: pi_theta / pi_behaviour, and weight 1. With it: pi_theta
    / pi_old (the trainer's own logprobs before this update, detached: 1 in value, the gradient of
    log pi_theta), and min(pi_old / pi_behaviour, tis_cap)."""
    old_BT = logprobs_BT.detach()
    if tis_cap > 0:
        ratio_BT = torch.exp(logprobs_BT - old_BT)
        tis_BT = torch.exp(old_BT - behaviour_logprobs_BT).clamp(max=tis_cap)
    else:
        ratio_BT = torch.exp(logprobs_BT - behaviour_logprobs_BT)
        tis_BT = torch.ones_like(logprobs_BT)
    return ratio_BT, tis_BT


def clip_sides(ratio_BT: torch.Tensor, advantages_B: torch.Tensor,
               clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(unclipped_BT, clipped_BT): ratio x advantage and the ratio clipped to 1 +- ``clip_eps`` x
    advantage, the two terms of PPO's pessimistic minimum."""
    clipped_BT = ratio_BT.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    adv_B1 = advantages_B[:, None]
    return ratio_BT * adv_B1, clipped_BT * adv_B1


def policy_coefficients(unclipped_BT: torch.Tensor, clipped_BT: torch.Tensor, tis_BT: torch.Tensor,
                        mask_BT: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """-d(pg)/d(logprob), detached: what the policy term weighs each token's score by (0 where the
    clip took the gradient away), per token as ``aggregate`` sums it, before the normalizer."""
    with torch.no_grad():
        coef_BT = torch.where(unclipped_BT <= clipped_BT, unclipped_BT * tis_BT, 0.0) * mask_BT
        if aggregation == "seq-mean-token-mean":
            coef_BT = coef_BT / mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
    return coef_BT


def token_means(token_weight_BT: torch.Tensor, **values_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each of ``values_BT``'s mean over the tokens, each token counted ``token_weight_BT`` times."""
    num_tokens = token_weight_BT.sum().clamp(min=1)
    return {name: (v_BT * token_weight_BT).sum() / num_tokens for name, v_BT in values_BT.items()}


def shared_direction_term(action_logprobs_MA: torch.Tensor, chosen_MA: torch.Tensor, coef_M: torch.Tensor) -> torch.Tensor:
    """A term whose gradient cancels what a policy loss's gradient shares across decisions.

    A loss -sum_i c_i log pi(a_i | s_i) gives decision i's action logits the gradient
    -c_i (onehot_i - pi_i). Adding sum_i m . log pi(. | s_i), with m the mean of c_i (onehot_i - pi_i)
    over the decisions (detached; its entries sum to 0, so the log-softmax's normaliser drops out),
    subtracts that mean from every decision's: what is left moves one state's answer against
    another's, never all of them one way. Biased by design: the mean is exactly the update that
    would shift every state alike, which a pretrained model's near-identical prompts make
    the whole of the step."""
    with torch.no_grad():
        mean_A = (coef_M[:, None] * (chosen_MA - action_logprobs_MA.exp())).mean(0)
    return (action_logprobs_MA * mean_A).sum()


def sft_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, mask_BT: torch.Tensor,
             normalizer: torch.Tensor | float) -> torch.Tensor:
    """Supervised next-token loss: the negative log-likelihood of the masked targets, summed and
    divided by ``normalizer`` (the loss tokens of the whole batch, on every rank: the gradient is
    then the same however the rows are split or packed)."""
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    nll_BT = -logp_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    return (nll_BT * mask_BT).sum() / normalizer


def sampling_logprobs(logits_BTV: torch.Tensor, allowed_ids: torch.Tensor | None = None,
                      temperature: float = 1.0) -> torch.Tensor:
    """The log-distribution the engine sampled from: logits divided by the sampling ``temperature``
    and, with ``allowed_ids``, renormalised over those tokens only (the others get -inf). Anything
    else would make the importance ratio wrong."""
    logits_BTV = logits_BTV.float() / (temperature if temperature > 0 else 1.0)
    if allowed_ids is not None:
        restricted_BTV = torch.full_like(logits_BTV, float("-inf"))
        restricted_BTV[..., allowed_ids] = logits_BTV[..., allowed_ids]
        logits_BTV = restricted_BTV
    return torch.log_softmax(logits_BTV, dim=-1)


def target_logprobs_and_entropy(logp_BTV: torch.Tensor, targets_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's log-probability under ``logp_BTV`` and that distribution's entropy."""
    token_logprobs_BT = logp_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    probs_BTV = logp_BTV.exp()
    entropy_BT = -(probs_BTV * torch.where(probs_BTV > 0, logp_BTV, torch.zeros_like(logp_BTV))).sum(-1)
    return token_logprobs_BT, entropy_BT


def token_logprobs_and_entropy(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, allowed_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of the distribution it came from, the
    one the engine sampled from (``sampling_logprobs``)."""
    return target_logprobs_and_entropy(sampling_logprobs(logits_BTV, allowed_ids, temperature), targets_BT)
