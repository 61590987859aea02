"""After a weight sync, does the engine compute what the trainer computes?

A wrong reload (a tied head left stale, a tensor-parallel slice misplaced, a dtype lost on the
way) does not crash: the engine keeps sampling, from the wrong distribution, and the importance
ratio silently absorbs it. So the driver asks policy-0 and the trainer the same questions:

- greedy agreement: the engine's greedy first token equals the trainer's argmax of the same
  distribution (over the allowed action tokens, at the sampling temperature);
- logprob difference: the engine's reported logprob of each token it sampled against the
  trainer's logprob of that token (the quantity the importance ratio is built from).
"""

from __future__ import annotations

import asyncio
import logging
import random

from ray_forge.core.episode import Scored, Turn
from ray_forge.identity import ActorId
from ray_forge.remote import call

log = logging.getLogger(__name__)


def compare(greedy: list[Turn], sampled: list[Turn], sampled_scored: list[Scored]) -> dict[str, float]:
    """``sync_greedy_agreement`` (share of prompts) and ``sync_logprob_max_diff`` (over every sampled
    token). ``greedy`` and ``sampled`` answer the same prompts in order: the trainer's argmax at the
    first response position depends on the prompt alone, so the sampled answers' scores serve both."""
    if [t.prompt_ids for t in greedy] != [t.prompt_ids for t in sampled]:
        raise ValueError("the greedy and the sampled answers of a sync check must be of the same prompts, in order")
    agree = sum(turn.response_ids[:1] == (score.argmax,) for turn, score in zip(greedy, sampled_scored, strict=True))
    diffs = [abs(engine - trainer)
             for turn, score in zip(sampled, sampled_scored, strict=True)
             for engine, trainer in zip(turn.logprobs, score.logprobs, strict=True)]
    return dict(sync_greedy_agreement=agree / max(1, len(greedy)), sync_logprob_max_diff=max(diffs, default=0.0))


def draw(prompts: list[str], count: int, seed: int) -> list[str]:
    """``count`` of ``prompts`` (all of them when ``count`` is 0 or not fewer), in their order, drawn by ``seed``."""
    if not count or count >= len(prompts):
        return list(prompts)
    return [prompts[i] for i in sorted(random.Random(seed).sample(range(len(prompts)), count))]


async def check(policy, name: ActorId, trainer, prompts: list[str], *, seed: int, tolerance: float,
                timeout_s: float) -> dict[str, float]:
    """Ask ``policy`` (the engine actor ``name``) and ``trainer`` (a TrainerGroup) about ``prompts``; log an
    error when they disagree beyond ``tolerance``."""
    # Ahead of the rollouts' requests (priority -1): the training loop waits for this check.
    greedy, sampled = await asyncio.gather(
        call(policy.generate.remote(prompts, True, None, -1), timeout_s=timeout_s, what="generate", actor=name),
        call(policy.generate.remote(prompts, False, seed, -1), timeout_s=timeout_s, what="generate", actor=name))
    row = compare(greedy, sampled, await trainer.score([(t.prompt_ids, t.response_ids) for t in sampled]))
    if row["sync_greedy_agreement"] < 1.0 or row["sync_logprob_max_diff"] > tolerance:
        log.error("%s disagrees with the trainer after the sync: greedy agreement %.4f, largest logprob "
                  "difference %.3g (tolerance %.3g); the engine is not sampling from the trained policy",
                  name, row["sync_greedy_agreement"], row["sync_logprob_max_diff"], tolerance)
    return row
