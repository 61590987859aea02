"""Which run --resume continues, and what it may not change (no Ray)."""

import json

import pytest
import yaml

from ray_forge.config import ConfigError, load_config, to_dict
from ray_forge.config.schema import JobConfig
from ray_forge.run.directory import FINISHED_FILE, latest_unfinished, open_run, truncate_metrics


def make_run(root, name, finished=False, **overrides):
    config = load_config(JobConfig, None, [f"run.output_dir={root}", *[f"{k}={v}" for k, v in overrides.items()]])
    (root / name).mkdir(parents=True)
    (root / name / "config.yaml").write_text(yaml.safe_dump(to_dict(config)))
    if finished:
        (root / name / FINISHED_FILE).write_text("{}")
    return root / name


def test_auto_takes_the_newest_unfinished_run_of_exactly_this_name(tmp_path):
    make_run(tmp_path, "blackjack-20261201-090000")
    newest = make_run(tmp_path, "blackjack-20261201-100000")
    make_run(tmp_path, "blackjack-20261201-110000", finished=True)
    make_run(tmp_path, "blackjack-tiny-20261201-120000")  # another run.name that starts the same
    config = load_config(JobConfig, None, [f"run.output_dir={tmp_path}", "run.name=blackjack"])
    assert latest_unfinished(config) == newest


def test_auto_starts_fresh_when_every_run_finished(tmp_path):
    make_run(tmp_path, "blackjack-20261201-110000", finished=True)
    config = load_config(JobConfig, None, [f"run.output_dir={tmp_path}", "run.name=blackjack"])
    assert latest_unfinished(config) is None


@pytest.mark.parametrize("override", ["grpo.prompts_per_step=8", "grpo.samples_per_prompt=4", "run.seed=5",
                                      "trainer.num_ranks=2"])
def test_a_resume_may_not_change_what_the_checkpoint_depends_on(tmp_path, override):
    run = make_run(tmp_path, "blackjack-20261201-100000", **{"run.name": "blackjack"})
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]} cannot change on resume"):
        open_run(str(run / "config.yaml"), [override], str(run))


def test_a_resume_may_train_longer(tmp_path):
    run = make_run(tmp_path, "blackjack-20261201-100000", **{"run.name": "blackjack", "run.steps": 10})
    resumed = open_run(str(run / "config.yaml"), ["run.steps=30"], str(run))
    assert resumed.config.run.steps == 30 and resumed.resumed and resumed.run_dir == run.resolve()
    assert resumed.resume_from is None  # no checkpoint yet: it starts again from step 0


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resuming_cuts_later_rows_and_writes_the_checkpoint_s_row_the_kill_left_out(tmp_path):
    """A kill may land after a checkpoint was committed but before its step's row was logged (the
    SFT job's CI failure: [1, 3, 4]); the row kept in the checkpoint fills the gap, once."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "wall_time_s": 1.5, "loss": 2.0}\n{"step": 3, "wall_ti')  # 2 never logged
    assert truncate_metrics(tmp_path, 2, {"loss": 1.25}) == 1.5
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "wall_time_s": 1.5, "loss": 2.0}, {"step": 2, "wall_time_s": 1.5, "loss": 1.25}]
    assert truncate_metrics(tmp_path, 2, {"loss": 9.0}) == 1.5 and _steps(path) == [1, 2]  # logged: kept as it was
    assert json.loads(path.read_text().splitlines()[1])["loss"] == 1.25
    path.write_text('{"step": 1, "wall_time_s": 1.5}\n{"step": 2, "wall_time_s": 2.5}\n{"step": 3, "wall_time_s": 3}\n')
    assert truncate_metrics(tmp_path, 2, {"loss": 9.0}) == 2.5 and _steps(path) == [1, 2]
    assert truncate_metrics(tmp_path, 0) == 0.0 and path.read_text() == ""
