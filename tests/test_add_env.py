"""A new env is one module exporting a spec and one registration: the real job trains it."""

from __future__ import annotations

from pathlib import Path

import pytest

from envs import registry
from ray_forge.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def light():
    from light_env import SPEC

    registry.register(SPEC)
    yield SPEC
    del registry.SPECS[SPEC.name]


def test_its_options_are_checked_like_any_config_section(light):
    from ray_forge.config import load_config
    from ray_forge.config.schema import JobConfig

    config = load_config(JobConfig, ROOT / "jobs/configs/blackjack_tiny.yaml",
                         ["env.name=light", "env.options.light.reward=2"])
    assert registry.setup(config.env).options == light.options(reward=2.0)
    bad = load_config(JobConfig, None, ["env.name=light", "env.options.light.rewrd=2"])
    with pytest.raises(ConfigError, match="unknown config key 'env.options.light.rewrd'"):
        registry.setup(bad.env)
    with pytest.raises(ConfigError, match="env.options.light.reward: expected float"):
        registry.setup(load_config(JobConfig, None, ["env.name=light", "env.options.light.reward=much"]).env)
    with pytest.raises(ValueError, match="registered already"):
        registry.register(type(light)(**{**light.__dict__, "corpus": lambda options: []}))


def test_the_readme_shows_this_very_env():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Add your own env"):]
    shown = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    source = (ROOT / "tests" / "light_env.py").read_text()
    assert source.endswith(shown) and shown.startswith("from dataclasses import dataclass")


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_a_registered_env_trains_for_two_steps(light, ray_cluster, tmp_path):
    from jobs import grpo
    from ray_forge.observe.metrics import read_metrics

    summary = grpo.main(["--config", str(ROOT / "jobs/configs/blackjack_tiny.yaml"), f"run.output_dir={tmp_path}",
                         "env.name=light", "env.options.light.reward=2.0", "env.max_turns=1", "run.name=light",
                         "run.steps=2", "run.eval_every=1", "grpo.prompts_per_step=8", "run.progress=false",
                         "model.tiny.num_layers=2", "cluster.include_dashboard=false", "policy.kv_cache_mb=64"])
    run_dir = Path(summary["run_dir"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and set(summary["policy_versions"]) == {3}  # 2 steps, then the demo's average
    for row in rows:
        assert row["num_games"] == 64 and row["env_errors"] == 0  # every answer was LEFT or RIGHT
        assert 0.0 < row["train_reward"] < 2.0  # its option reached the env actors: right answers earn 2
        assert row["eval_policy_version"] == row["step"] and 0.0 <= row["eval_return"] <= 2.0
    assert summary["eval_return"] == summary["return"] and len(summary["answers"]) == 8
    assert {answer.strip() for answer in summary["answers"]} <= {"LEFT", "RIGHT"}
    assert (run_dir / "final_policy" / "config.json").is_file()
