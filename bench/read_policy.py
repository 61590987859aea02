"""An independent reading of a BlackJack run's final policy: plain transformers and the exact DP.

The run's own evaluation asks its vLLM engine for a greedy answer in each of the 360 states and
values the table exactly. This reads the saved ``final_policy/`` folder with transformers
instead (no vLLM, no Ray, no ray_forge model code): each state's prompt as the run asked it (its
action words, and its chat template and system turn when ``policy.chat_prompts``), the greedy
choice between the action words' tokens, then the exact return of that table. The two agree when
the weights, the prompts and the evaluation are what the run says they are. It also reports the
probability of hitting by the player's hard sum (the mean over the dealer's cards).

    python -m bench.read_policy runs/blackjack-smollm2-<time>

Last line: a JSON object with both returns and their difference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml

from envs.blackjack import ACTION_WORDS, Wording, parse_action, render_state
from envs.blackjack.exact import all_states, evaluate_table
from ray_forge.core.chat import text_prompt_ids

CHUNK = 40


def prompt_ids(tokenizer, states, policy: dict, wording: Wording) -> list[list[int]]:
    """The ids the run's engine was given for each of ``states`` (its ``policy`` section's chat settings)."""
    encode = text_prompt_ids(tokenizer, bool(policy.get("chat_prompts")), policy.get("system_prompt"))
    return [list(encode(render_state(state, wording))) for state in states]


def wording_of(config: dict, numbers: str | None = None) -> Wording:
    """How a job config's BlackJack prompts are worded (``numbers`` in place of the config's)."""
    options = config["env"].get("options", {}).get("blackjack", {})
    return Wording(tuple(options.get("words", ACTION_WORDS)), numbers or options.get("numbers", "digits"))


def action_ids(tokenizer, words: tuple[str, str]) -> dict[int, int]:
    """Each single-token spelling of the words (bare or after a space) -> its action (1 hit, 0 stick)."""
    ids = {}
    for word in words:
        for text in (word, " " + word):
            pieces = tokenizer.encode(text, add_special_tokens=False)
            if len(pieces) == 1:
                ids[pieces[0]] = parse_action(word)
    return ids


def read(run_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    wording = wording_of(config)
    folder = run_dir / "final_policy"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    choices = action_ids(tokenizer, wording.words)
    allowed = torch.tensor(sorted(choices))
    states = all_states()
    prompts = prompt_ids(tokenizer, states, config["policy"], wording)
    table, hit_prob = {}, {}
    with torch.no_grad():
        for first in range(0, len(states), CHUNK):
            chunk = prompts[first:first + CHUNK]
            batch = torch.zeros(len(chunk), max(map(len, chunk)), dtype=torch.long)
            for row, ids in enumerate(chunk):  # right padding: a causal model never looks ahead
                batch[row, :len(ids)] = torch.tensor(ids)
            hidden = model.model(batch).last_hidden_state[torch.arange(len(chunk)), [len(ids) - 1 for ids in chunk]]
            probs = model.lm_head(hidden)[:, allowed].softmax(-1)
            for state, row_probs in zip(states[first:first + CHUNK], probs):
                table[state] = float(choices[int(allowed[row_probs.argmax()])])
                hit_prob[state] = sum(float(p) for p, i in zip(row_probs, allowed.tolist()) if choices[i] == 1)
    mine = evaluate_table(table)
    theirs = json.loads((run_dir / "eval.json").read_text())["exact_return"]
    return dict(bench="read_policy", run_dir=str(run_dir), exact_return=mine, run_exact_return=theirs,
                difference=abs(mine - theirs), hit_states=int(sum(table.values())),
                hard_hit_probability=hit_probability_by_sum(hit_prob))


def hit_probability_by_sum(hit_prob: dict) -> dict[int, float]:
    """The mean probability of hitting over the dealer's cards, by the player's hard sum: whether the
    policy has begun to tell states apart, which the greedy table hides while one answer leads everywhere."""
    sums: dict[int, list[float]] = {}
    for state, prob in hit_prob.items():
        if not state.usable_ace:
            sums.setdefault(state.player_sum, []).append(prob)
    return {total: round(sum(probs) / len(probs), 4) for total, probs in sorted(sums.items())}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    result = read(parser.parse_args(argv).run_dir)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
