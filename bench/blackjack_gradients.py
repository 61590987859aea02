"""Why a pretrained model's BlackJack table flips as a block: its states' gradients are one.

For a model folder (default: the converted SmolLM2), asked as ``jobs/configs/blackjack_smollm2.yaml``
asks it (its chat and system-turn settings, its action words and its numbers, digits or words,
unless ``--numbers`` says otherwise), this reads with plain transformers:

- ``probe_accuracy``: a logistic regression on the final hidden state at the answer position,
  fitted to the optimal table's action with 5-fold cross-validation, and the exact return of the
  table it predicts. High: the state is there to be read.
- ``shared_share``: the answer-logit gradient (log p(hit) - log p(stick), over every parameter) of
  a spread of hard states, and the share of their squared norm that is their common mean. Near 1:
  a policy-gradient step moves every state's answer the same way, whatever the advantages say.
- ``hit_probability``: the zero-shot probability of hitting by hard sum (the mean over dealers).

    python -m bench.blackjack_gradients [--model models/smollm2-135m] [--numbers words]

Last line: a JSON object with the three.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml

from bench.read_policy import CHUNK, action_ids, hit_probability_by_sum, prompt_ids, wording_of
from envs.blackjack import State, Wording
from envs.blackjack.exact import all_states, evaluate_table, optimal_table

CONFIG = Path(__file__).resolve().parent.parent / "jobs" / "configs" / "blackjack_smollm2.yaml"
GRADIENT_STATES = [State(total, dealer, False) for total in (5, 8, 11, 14, 17, 20) for dealer in (3, 7)]


def answer_logit(model, ids: list[int], hit: list[int], stick: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden state and log p(hit) - log p(stick) at the answer position."""
    hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    logits = model.lm_head(hidden)
    return hidden, torch.logsumexp(logits[hit], -1) - torch.logsumexp(logits[stick], -1)


def answer_logits(model, prompts: list[list[int]], hit: list[int], stick: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``answer_logit`` of many prompts, in right-padded batches (a causal model never looks ahead)."""
    hidden = []
    for first in range(0, len(prompts), CHUNK):
        chunk = prompts[first:first + CHUNK]
        batch = torch.zeros(len(chunk), max(map(len, chunk)), dtype=torch.long)
        for row, ids in enumerate(chunk):
            batch[row, :len(ids)] = torch.tensor(ids)
        states = model.model(batch).last_hidden_state
        hidden.append(states[torch.arange(len(chunk)), [len(ids) - 1 for ids in chunk]])
    hidden = torch.cat(hidden)
    logits = model.lm_head(hidden)
    return hidden, torch.logsumexp(logits[:, hit], -1) - torch.logsumexp(logits[:, stick], -1)


def probe(features: torch.Tensor, labels: torch.Tensor, folds: int = 5) -> torch.Tensor:
    """Cross-validated predictions of an L2-regularised logistic regression on standardised features."""
    features = (features - features.mean(0)) / (features.std(0) + 1e-6)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    predictions = torch.zeros_like(labels)
    for fold in order.chunk(folds):
        train = order[~torch.isin(order, fold)]
        weight = torch.zeros(features.shape[1] + 1, requires_grad=True)
        optimizer = torch.optim.LBFGS([weight], max_iter=200)

        def closure():
            optimizer.zero_grad()
            scores = features[train] @ weight[:-1] + weight[-1]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, labels[train]) + 1e-2 * weight[:-1].square().sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            predictions[fold] = (features[fold] @ weight[:-1] + weight[-1] > 0).float()
    return predictions


def shared_share(model, tokenizer, policy: dict, wording: Wording, hit: list[int], stick: list[int]) -> float:
    """Share of the states' gradients' squared norm that their mean carries: n |mean|^2 / sum |g|^2
    (one running sum, not n gradients of 135M weights kept at once)."""
    total, squares = None, 0.0
    for ids in prompt_ids(tokenizer, GRADIENT_STATES, policy, wording):
        model.zero_grad()
        answer_logit(model, ids, hit, stick)[1].backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        total = grad if total is None else total.add_(grad)
        squares += float(grad.square().sum())
    return float(total.square().sum()) / len(GRADIENT_STATES) / squares


def measure(folder: str, numbers: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = yaml.safe_load(CONFIG.read_text())
    policy, wording = config["policy"], wording_of(config, numbers)
    choices = action_ids(tokenizer, wording.words)
    hit = [token for token, action in choices.items() if action == 1]
    stick = [token for token, action in choices.items() if action == 0]
    states, best = all_states(), optimal_table()
    with torch.no_grad():
        hidden, logit = answer_logits(model, prompt_ids(tokenizer, states, policy, wording), hit, stick)
    labels = torch.tensor([best[s] for s in states])
    predicted = probe(hidden, labels)
    return dict(bench="blackjack_gradients", model=folder, numbers=wording.numbers,
                probe_accuracy=round(float((predicted == labels).float().mean()), 4),
                probe_exact_return=round(evaluate_table(dict(zip(states, predicted.tolist()))), 4),
                optimal_exact_return=round(evaluate_table(best), 4),
                shared_share=round(shared_share(model, tokenizer, policy, wording, hit, stick), 4),
                hit_probability=hit_probability_by_sum({s: float(d.sigmoid()) for s, d in zip(states, logit)}))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m")
    parser.add_argument("--numbers", choices=["digits", "words"], help="env.options.blackjack.numbers (default: the config's)")
    args = parser.parse_args(argv)
    result = measure(args.model, args.numbers)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
