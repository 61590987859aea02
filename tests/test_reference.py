"""bench/reference.py, the single-process GRPO that the pipeline is measured against: its games
are real GRPO groups, and a short run trains and reports, so the reference cannot rot."""

import math
from pathlib import Path

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


def test_a_short_run_trains_and_reports(capsys):
    result = reference.main(["--steps", "2", "--eval-every", "1", "grpo.games_per_step=64", "trainer.lr=1e-2"])
    assert result["steps"] == 2 and set(result["evals"]) == {1, 2}
    assert -1.0 <= result["final_exact_return"] <= 1.0 and result["step_s_median"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"bench": "reference"')
