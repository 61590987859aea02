"""The single-process limit: plain GRPO on BlackJack in one process, no Ray, no vLLM, no TorchTitan.

One Hugging Face Qwen3 in torch plays every game of a step itself: at each turn the distinct
prompts of all games still playing go through one forward pass (at most 360 states exist), each
game samples its action from the restricted distribution (HIT/STICK tokens, temperature 1), and
the step trains on the same GRPO loss, advantages and sample merging as ``jobs/grpo.py``
(``ray_forge.core.algorithm``, ``ray_forge.core.batch``). It uses the `make demo` config: the same tiny model,
games per step, group size, learning rate and schedule. Synchronous: every batch is on-policy.

It is what a pipeline with actors is measured against (issue 13): run it beside ``make demo`` in
the same sitting and compare the times to an exact return of ``--target``.

    python bench/reference.py [--steps 170] [--target -0.060] [--eval-every 10] [overrides ...]

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from envs.blackjack import ACTION_WORDS, BlackjackTextEnv, evaluate
from ray_forge.actors.policy import action_token_ids
from ray_forge.actors.trainer import lr_factor
from ray_forge.config import load_config
from ray_forge.config.schema import JobConfig
from ray_forge.core.algorithm import grpo_loss, loss_normalizer
from ray_forge.core.batch import collate, groups_to_samples, sampled_logprobs
from ray_forge.core.episode import Episode, Turn
from ray_forge.models.tiny import make_tiny_qwen3

CONFIG = ROOT / "jobs/configs/blackjack_tiny.yaml"


class Player:
    """The model, its tokenizer and the action tokens it may sample."""

    def __init__(self, model_dir: Path, temperature: float) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.allowed = torch.tensor(action_token_ids(self.tokenizer, ACTION_WORDS))
        self.temperature = temperature

    def last_logits(self, prompts: list[str]) -> tuple[list[tuple[int, ...]], torch.Tensor]:
        """Token ids of each distinct prompt and its next-token logits, in one forward pass."""
        ids = [tuple(self.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
        width = max(len(i) for i in ids)
        batch = torch.zeros(len(ids), width, dtype=torch.long)
        for row, tokens in enumerate(ids):  # right padding: a causal model never looks ahead
            batch[row, :len(tokens)] = torch.tensor(tokens)
        with torch.no_grad():
            logits = self.model(batch).logits
        return ids, logits[torch.arange(len(ids)), torch.tensor([len(i) - 1 for i in ids])]

    def decide(self, prompts: list[str]) -> list[str]:
        """Greedy answers (the evaluation's ``decide``)."""
        _, logits = self.last_logits(list(dict.fromkeys(prompts)))
        best = {p: self.allowed[logits[row, self.allowed].argmax()] for row, p in enumerate(dict.fromkeys(prompts))}
        return [self.tokenizer.decode([int(best[p])]) for p in prompts]


def play(player: Player, seeds: list[int], group_size: int, penalty: float, version: int) -> list[list[Episode]]:
    """Every game of the step, turn by turn; the distinct prompts of a turn share one forward."""
    envs = [BlackjackTextEnv(penalty) for _ in range(len(seeds) * group_size)]
    texts = [env.reset(seeds[i // group_size]) for i, env in enumerate(envs)]
    turns: list[list[Turn]] = [[] for _ in envs]
    rewards = [0.0] * len(envs)
    live = list(range(len(envs)))
    while live:
        distinct = list(dict.fromkeys(texts[i] for i in live))
        ids, logits = player.last_logits(distinct)
        logprobs = torch.log_softmax(logits[:, player.allowed] / player.temperature, dim=-1)
        row_of = {p: row for row, p in enumerate(distinct)}
        rows = torch.tensor([row_of[texts[i]] for i in live])
        choice = torch.multinomial(logprobs[rows].exp(), 1).squeeze(1)
        still = []
        for game, row, pick in zip(live, rows.tolist(), choice.tolist()):
            token = int(player.allowed[pick])
            turns[game].append(Turn(prompt_ids=ids[row], response_ids=(token,), logprobs=(float(logprobs[row, pick]),),
                                    policy_version=version))
            result = envs[game].step(player.tokenizer.decode([token]))
            rewards[game] += result.reward
            if result.done:
                continue
            texts[game] = result.observation
            still.append(game)
        live = still
    return [[Episode(group_id=g, seed=seeds[g], turns=tuple(turns[g * group_size + k]), reward=rewards[g * group_size + k])
             for k in range(group_size)] for g in range(len(seeds))]


def train_step(player: Player, optimizer, config: JobConfig, groups: list[list[Episode]]) -> dict:
    samples, stats = groups_to_samples(groups, merge=config.trainer.merge_identical, scale=config.grpo.scale_rewards)
    if samples:
        batch = collate(samples)
        normalizer = loss_normalizer(batch.mask_BT, batch.weights_B, config.grpo.token_aggregation)
        logprobs, entropy = sampled_logprobs(lambda inputs, rows: player.model(inputs).logits[rows], batch.inputs_BT,
                                             batch.targets_BT, batch.mask_BT, player.allowed, player.temperature)
        terms = grpo_loss(logprobs, batch.behaviour_logprobs_BT, batch.advantages_B, batch.mask_BT,
                          clip_eps=config.grpo.clip_eps, weights_B=batch.weights_B, entropy_BT=entropy,
                          entropy_coef=config.grpo.entropy_coef, aggregation=config.grpo.token_aggregation,
                          normalizer=normalizer)
        terms.loss.backward()
        torch.nn.utils.clip_grad_norm_(player.model.parameters(), config.trainer.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return stats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the demo's run.steps")
    parser.add_argument("--target", type=float, default=-0.060, help="exact return to reach")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, as jobs/grpo.py takes them")
    args = parser.parse_args(argv)
    config = load_config(JobConfig, CONFIG, args.overrides)
    steps = args.steps or config.run.steps
    torch.manual_seed(config.run.seed)
    torch.set_num_threads(args.threads)
    model_dir = make_tiny_qwen3(Path(tempfile.mkdtemp(prefix="reference_")) / "model", BlackjackTextEnv.corpus(),
                                config.model.tiny)
    player = Player(model_dir, config.policy.temperature)
    optimizer = torch.optim.AdamW(player.model.parameters(), lr=config.trainer.lr,
                                  weight_decay=config.trainer.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, steps, config.trainer.warmup_steps, config.trainer.min_lr_ratio))
    num_groups = config.grpo.prompts_per_step
    step_s, evals, eval_at_s, reached = [], {}, {}, None
    start = time.perf_counter()
    for step in range(1, steps + 1):
        begin = time.perf_counter()
        seeds = [config.run.seed * 10**9 + step * num_groups + g for g in range(num_groups)]
        groups = play(player, seeds, config.grpo.samples_per_prompt, config.env.invalid_action_penalty, step - 1)
        stats = train_step(player, optimizer, config, groups)
        schedule.step()
        step_s.append(time.perf_counter() - begin)
        if step % args.eval_every == 0 or step == steps:
            player.model.eval()
            evals[step] = evaluate(player.decide, invalid_action_penalty=config.env.invalid_action_penalty)["exact_return"]
            player.model.train()
            eval_at_s[step] = time.perf_counter() - start
            print(f"step {step}: reward {stats['train_reward']:+.4f}, exact return {evals[step]:+.4f}, "
                  f"{statistics.median(step_s):.2f} s/step", file=sys.stderr, flush=True)
            if reached is None and evals[step] >= args.target:
                reached = (step, time.perf_counter() - start)  # evaluation time included, as in the job
    result = dict(bench="reference", steps=steps, games_per_step=config.grpo.games_per_step,
                  group_size=config.grpo.samples_per_prompt, step_s_median=statistics.median(step_s),
                  total_s=time.perf_counter() - start, target=args.target,
                  step_at_target=reached and reached[0], seconds_to_target=reached and reached[1],
                  final_exact_return=evals[steps], evals=evals, eval_at_s=eval_at_s)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
