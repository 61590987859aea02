"""bench/cpu_work.py: the machine's busy CPU time is read around a command, and per step is the
difference of two run lengths, so start-up and shutdown cancel out."""

import sys

import pytest

from bench import cpu_work

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"


def test_the_cpu_time_of_a_command_is_counted():
    cpu_s, wall_s = cpu_work.measure([sys.executable, "-c", BURN], background_rate=0.0)
    assert cpu_s >= 0.45 and wall_s >= 0.45, (cpu_s, wall_s)  # the command's own 0.5 CPU-s, at least


def test_a_command_that_fails_is_an_error_with_its_output():
    with pytest.raises(RuntimeError, match=r"rc 3\):\nboom"):
        cpu_work.measure([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"], 0.0)


def test_per_step_is_the_difference_of_two_run_lengths(monkeypatch):
    # 12 CPU-s and 30 s of start-up and shutdown, then 1.5 CPU-s and 0.75 s per step.
    monkeypatch.setattr(cpu_work, "measure", lambda command, rate: (12 + 1.5 * command[0], 30 + 0.75 * command[0]))
    result = cpu_work.per_step("x", lambda n, overrides, out: [n], 10, 40, [], 0.0)
    assert result == dict(cpu_s_per_step=1.5, wall_s_per_step=0.75, cores_busy=2.0)


def test_the_pipeline_runs_without_the_demos_checks_and_with_them_as_made():
    without = cpu_work.pipeline(40, ["grpo.samples_per_prompt=4"], "/tmp/x")
    made = cpu_work.as_made(40, ["grpo.samples_per_prompt=4"], "/tmp/x")
    checks = {"run.eval_every=0", "run.checkpoint_every=0", "run.sync_check_every=0"}
    assert checks <= set(without) and not checks & set(made)
    assert set(made) <= set(without) and "grpo.samples_per_prompt=4" in made and "run.steps=40" in made
