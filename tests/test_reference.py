"""bench/reference.py, the single-process GRPO that the pipeline is measured against: its games
are real GRPO groups, and a short run moves its weights and reports the exact return of the policy
it ends with, so the reference cannot rot."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

from bench import reference


def test_a_group_plays_one_deal_and_records_the_sampling_distribution(tiny_model_dir):
    player = reference.Player(Path(tiny_model_dir), temperature=1.0)
    groups = reference.play(player, seeds=[3, 4], group_size=8, penalty=-1.0, version=0)
    assert [len(g) for g in groups] == [8, 8]
    for group in groups:
        assert len({e.turns[0].prompt_ids for e in group}) == 1  # the same cards for the whole group
        for episode in group:
            assert episode.reward in (-1.0, 0.0, 1.0) and episode.turns
            for turn in episode.turns:
                assert turn.response_ids[0] in player.allowed.tolist() and turn.logprobs[0] <= 0
    # The recorded logprob is the one the trainer will compute for that token.
    turn = groups[0][0].turns[0]
    _, logits = player.last_logits([player.tokenizer.decode(list(turn.prompt_ids))])
    expected = torch.log_softmax(logits[0, player.allowed], -1)[player.allowed.tolist().index(turn.response_ids[0])]
    assert math.isclose(turn.logprobs[0], float(expected), abs_tol=1e-5)


def test_a_short_run_moves_the_weights_and_reports_the_exact_return_of_its_final_policy(monkeypatch, capsys):
    """Without weight decay only a gradient moves a weight, so moved weights mean the GRPO loss
    trained. The reported return is the exact value of the final weights' greedy table, read here
    prompt by prompt (no batching, no ``evaluate``), and the JSON line and the progress lines
    report the same numbers."""
    from envs.blackjack import evaluate_table, parse_action, render_state
    from envs.blackjack.exact import all_states

    players = []

    class KeptPlayer(reference.Player):
        """The bench's player, kept with a copy of its weights before training."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}
            players.append(self)

    monkeypatch.setattr(reference, "Player", KeptPlayer)
    result = reference.main(["--steps", "2", "--eval-every", "1", "--target", "-1.0", "grpo.prompts_per_step=8",
                             "trainer.lr=1e-2", "trainer.weight_decay=0.0"])
    [player] = players
    final = player.model.state_dict()
    assert [k for k in final if not torch.equal(final[k], player.initial[k])], "no weight moved"
    assert all(torch.isfinite(v).all() for v in final.values())

    player.model.eval()
    table = {}
    for state in all_states():
        ids = player.tokenizer.encode(render_state(state), add_special_tokens=False)
        with torch.no_grad():
            logits = player.model(torch.tensor([ids])).logits[0, -1]
        action = parse_action(player.tokenizer.decode([int(player.allowed[logits[player.allowed].argmax()])]))
        assert action in (0, 1), state  # the choice is restricted to the action tokens
        table[state] = float(action)
    assert result["final_exact_return"] == pytest.approx(evaluate_table(table), abs=1e-9)

    assert result["steps"] == 2 and sorted(result["evals"]) == [1, 2]
    assert result["evals"][2] == result["final_exact_return"]
    assert result["step_at_target"] == 1  # every return reaches -1
    assert result["eval_at_s"][1] <= result["seconds_to_target"] <= result["eval_at_s"][2] <= result["total_s"]
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(result))
    progress = re.findall(r"^step (\d+): reward [-+]\d\.\d{4}, exact return ([-+]\d\.\d{4}),", err, re.MULTILINE)
    assert progress == [(str(step), f"{value:+.4f}") for step, value in result["evals"].items()]
