"""Samples -> padded tensors for the trainer and the reference model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ray_forge.core.algorithm import (Baseline, RewardScale, group_advantages, keyed_advantages, sampling_logprobs,
                                     target_logprobs_and_entropy)
from ray_forge.core.episode import Episode, Sample, episodes_to_samples, merge_identical
from ray_forge.core.play import episode_metrics


@dataclass
class TensorBatch:
    """Right-padded next-token batch. Row b predicts ``targets_BT[b, t]`` from ``inputs_BT[b, :t+1]``."""

    inputs_BT: torch.Tensor
    targets_BT: torch.Tensor
    mask_BT: torch.Tensor
    """1.0 where the target is a sampled token (the only positions with a loss)."""
    behaviour_logprobs_BT: torch.Tensor
    advantages_B: torch.Tensor
    weights_B: torch.Tensor
    ref_logprobs_BT: torch.Tensor | None

    def to(self, device: str) -> "TensorBatch":
        return TensorBatch(**{k: v.to(device) if v is not None else None for k, v in self.__dict__.items()})


def collate(samples: list[Sample], pad_id: int = 0) -> TensorBatch:
    num_rows = len(samples)
    width = max(len(s.token_ids) for s in samples) - 1
    inputs = torch.full((num_rows, width), pad_id, dtype=torch.long)
    targets = torch.full((num_rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros(num_rows, width)
    behaviour = torch.zeros(num_rows, width)
    has_ref = all(s.ref_logprobs is not None for s in samples)
    ref = torch.zeros(num_rows, width) if has_ref else None
    for row, s in enumerate(samples):
        tokens = torch.tensor(s.token_ids, dtype=torch.long)
        length = len(s.token_ids) - 1
        inputs[row, :length] = tokens[:-1]
        targets[row, :length] = tokens[1:]
        # Token t + 1 is predicted at position t: a sampled token's loss sits one place before it.
        # A sample's first token is never predicted, so it can carry no loss.
        if s.loss_mask[0]:
            raise ValueError("a sample's first token has a loss: nothing before it predicts it")
        positions = torch.tensor(s.loss_mask[1:], dtype=torch.bool).nonzero().flatten()
        mask[row, positions] = 1.0
        behaviour[row, positions] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        if ref is not None:
            ref[row, positions] = torch.tensor(s.ref_logprobs, dtype=torch.float32)
    return TensorBatch(
        inputs_BT=inputs, targets_BT=targets, mask_BT=mask, behaviour_logprobs_BT=behaviour,
        advantages_B=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        weights_B=torch.tensor([s.weight for s in samples], dtype=torch.float32),
        ref_logprobs_BT=ref,
    )


HeadForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``forward(inputs_DT, rows_DT)``: the model on ``inputs_DT``, its output head applied only at
the positions where ``rows_DT`` is true (``[N, V]``, in row-major order)."""


def sampled_logprobs(forward: HeadForward, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, mask_BT: torch.Tensor,
                     allowed_ids: torch.Tensor | None = None,
                     temperature: float = 1.0, with_actions: bool = False) -> tuple[torch.Tensor, ...]:
    """Each sampled target's logprob and its distribution's entropy (``token_logprobs_and_entropy``)
    where ``mask_BT`` is set, zero elsewhere; gradients flow as if each row ran its own forward.

    Two savings, both exact. Each distinct input row runs once: merged samples of one state share
    their input and differ only in the token they predict or their advantage's sign (in a BlackJack
    batch half the rows repeat another's input). And the output head runs only at the positions
    some row reads: a one-token answer reads one position of its prompt, and a full head at every
    position costs a vocabulary-wide row each (49k floats for SmolLM2), several copies over.

    ``with_actions`` adds a third value for ``grpo_loss``'s ``actions``: each read token's logprobs
    over ``allowed_ids`` (the distribution it was drawn from) and a one-hot of the one drawn."""
    read_BT = mask_BT > 0
    distinct_DT, inverse_B = torch.unique(inputs_BT, dim=0, return_inverse=True)
    need_DT = torch.zeros(distinct_DT.shape, dtype=torch.long, device=inputs_BT.device)
    need_DT = need_DT.index_add_(0, inverse_B, read_BT.long()) > 0
    slot_DT = need_DT.flatten().cumsum(0).view_as(need_DT) - 1  # each needed position's row in the head's output
    logits_MV = forward(distinct_DT, need_DT)[slot_DT[inverse_B][read_BT]]
    targets_M = targets_BT[read_BT]
    logp_MV = sampling_logprobs(logits_MV, allowed_ids, temperature)
    logprobs_M, entropy_M = target_logprobs_and_entropy(logp_MV, targets_M)
    where = read_BT.nonzero(as_tuple=True)
    zeros_BT = logprobs_M.new_zeros(read_BT.shape)
    out = zeros_BT.index_put(where, logprobs_M), zeros_BT.index_put(where, entropy_M)
    if not with_actions:
        return out
    if allowed_ids is None:
        raise ValueError("with_actions needs allowed_ids: the action words' tokens")
    return *out, (logp_MV[:, allowed_ids], (targets_M[:, None] == allowed_ids[None, :]).to(logp_MV.dtype))


def inputs_together(samples: list[Sample]) -> list[Sample]:
    """``samples`` ordered so that rows with the same input (tokens but the last) are neighbours.

    ``sampled_logprobs`` runs each distinct input once *within a micro-batch*; a BlackJack batch
    holds up to four rows per state (each answer, each advantage sign), and in the buffer's order
    they rarely share one. The loss is a sum over rows, so the order changes no gradient."""
    return sorted(samples, key=lambda s: s.token_ids[:-1])


def response_logprobs(batch: TensorBatch, logprobs_BT: torch.Tensor) -> list[tuple[float, ...]]:
    """Per-row response-token logprobs, in the layout of ``Sample.behaviour_logprobs``."""
    rows = []
    for row in range(logprobs_BT.shape[0]):
        positions = batch.mask_BT[row].nonzero().flatten()
        rows.append(tuple(logprobs_BT[row, positions].tolist()))
    return rows


def groups_to_samples(groups: list[list[Episode]], merge: bool, trainer_version: int = 0,
                      scale: RewardScale = "group", baseline: Baseline = "group") -> tuple[list[Sample], dict[str, float]]:
    """GRPO advantages, turns flattened to samples, those without signal dropped.

    ``baseline`` "group": a game's reward minus its group's mean, on every turn of the game (a
    group whose rewards are all equal is dropped). "prompt": a turn's game reward minus the mean
    over every turn in the batch asked the same prompt, whatever group it came from (a prompt
    whose turns all scored alike is dropped); see ``keyed_advantages``.

    ``policy_lag`` and ``policy_lag_max``: versions between the weights that sampled each trained
    token and ``trainer_version`` (the weights the trainer takes the step from), token mean and max."""
    episodes = [e for group in groups for e in group]
    rewards = torch.tensor([e.reward for e in episodes])
    if baseline == "group":
        advantages, keep = group_advantages(rewards, group_size=len(groups[0]), scale=scale)
        kept = [(e, a) for e, a, k in zip(episodes, advantages.tolist(), keep.tolist()) if k]
        samples = episodes_to_samples([e for e, _ in kept], [a for _, a in kept])
        signal = dict(groups_kept=float(keep.float().mean()))
    elif baseline == "prompt":
        samples, signal = _prompt_baseline_samples(episodes, scale)
    else:
        raise ValueError(f"baseline must be 'group' or 'prompt', got {baseline!r}")
    lags = [trainer_version - v for s in samples for v in s.token_versions]
    stats = dict(train_reward=float(rewards.mean()), num_games=len(episodes), **signal, num_samples=len(samples),
                 env_errors=sum(e.error is not None for e in episodes),
                 sample_policy_version=sum(s.policy_version for s in samples) / max(1, len(samples)),
                 policy_lag=sum(lags) / max(1, len(lags)), policy_lag_max=max(lags, default=0),
                 **episode_metrics(episodes))
    if merge:
        samples = merge_identical(samples)
    stats["num_rows"] = len(samples)
    stats["row_tokens"] = sum(len(s.token_ids) for s in samples)  # what the trainer's forward runs over
    return samples, stats


def _prompt_baseline_samples(episodes: list[Episode], scale: RewardScale) -> tuple[list[Sample], dict[str, float]]:
    """Every turn credited with its game's reward minus the mean over the batch's turns of the same
    prompt (the tokens before its first sampled one); ``turns_kept`` is the share with signal."""
    samples = episodes_to_samples(episodes, [e.reward for e in episodes])
    prompts: dict[tuple[int, ...], int] = {}
    keys = [prompts.setdefault(s.token_ids[:next((i for i, m in enumerate(s.loss_mask) if m), None)], len(prompts))
            for s in samples]
    if not samples:
        return [], dict(turns_kept=0.0)
    advantages, keep = keyed_advantages(torch.tensor([s.advantage for s in samples]), torch.tensor(keys), scale)
    kept = [replace(s, advantage=a) for s, a, k in zip(samples, advantages.tolist(), keep.tolist()) if k]
    return kept, dict(turns_kept=float(keep.float().mean()), distinct_prompts=len(prompts))


@dataclass
class PackedBatch:
    """Packed SFT rows, right-padded. Row b predicts ``targets_BT[b, t]`` from the tokens of its
    own document up to ``t``; ``attention_B1TT[b, 0, i, j]`` is True where position i may see j
    (None when every row is one document: plain causal attention, the faster kernel)."""

    inputs_BT: torch.Tensor
    targets_BT: torch.Tensor
    mask_BT: torch.Tensor
    positions_BT: torch.Tensor
    attention_B1TT: torch.Tensor | None

    def to(self, device: str) -> "PackedBatch":
        return PackedBatch(**{k: v.to(device) if v is not None else None for k, v in self.__dict__.items()})


def collate_packed(rows: list, pad_id: int = 0) -> PackedBatch:
    """``ray_forge.core.sft.Packed`` rows as tensors; padding attends only to itself and has no loss."""
    width = max(len(r.token_ids) for r in rows) - 1
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    docs = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row.token_ids) - 1
        ids, doc = torch.tensor(row.token_ids), torch.tensor(row.document_ids)
        inputs[b, :n], targets[b, :n] = ids[:-1], ids[1:]
        # A document's next token is predicted only inside it; its first token carries no loss.
        mask[b, :n] = torch.tensor(row.loss_mask[1:], dtype=torch.float32) * (doc[1:] == doc[:-1])
        positions[b, :n] = torch.tensor(row.positions[:-1])
        docs[b, :n] = doc[:-1]
    if all(max(row.document_ids) == 0 for row in rows):
        return PackedBatch(inputs, targets, mask, positions, None)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same = (docs[:, :, None] == docs[:, None, :]) & (docs[:, :, None] >= 0)
    attention = (same & causal) | torch.eye(width, dtype=torch.bool)  # a padding query sees itself: no NaN
    return PackedBatch(inputs, targets, mask, positions, attention[:, None])
