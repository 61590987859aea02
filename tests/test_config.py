"""Strict config loading (no Ray)."""

from pathlib import Path

import pytest

from ray_forge.config import ConfigError, load_config
from ray_forge.config.schema import JobConfig

CONFIGS = Path(__file__).parent.parent / "jobs" / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    from envs import registry
    from ray_forge.config.schema import SFTConfig

    if path.name.startswith("sft_"):  # the SFT job's (jobs/sft.py)
        config = load_config(SFTConfig, path)
        assert config.data.max_tokens >= 2 and config.trainer.num_ranks >= 1
        return
    config = load_config(JobConfig, path)
    assert config.grpo.games_per_step % config.grpo.group_size == 0
    registry.setup(config.env)  # its env's own options are valid too


def test_an_sft_config_is_as_strict_as_the_grpo_one():
    from ray_forge.config.schema import SFTConfig

    with pytest.raises(ConfigError, match="unknown config key 'data.batch'"):
        load_config(SFTConfig, CONFIGS / "sft_tools_tiny.yaml", ["data.batch=3"])
    with pytest.raises(ConfigError, match="data.batch_size = 0 is out of range"):
        load_config(SFTConfig, CONFIGS / "sft_tools_tiny.yaml", ["data.batch_size=0"])
    assert load_config(SFTConfig, CONFIGS / "sft_tools_tiny.yaml", ["trainer.lr=1e-3"]).trainer.lr == 1e-3


def test_dotted_overrides_are_typed():
    config = load_config(JobConfig, None, ["trainer.lr=3e-5", "grpo.group_size=4", "policy.resources.num_cpus=2",
                                           "cluster.pool_labels={gpu: g1}", "run.keep_best=true"])
    assert config.trainer.lr == 3e-5 and isinstance(config.trainer.lr, float)
    assert config.grpo.group_size == 4
    assert config.policy.resources.num_cpus == 2.0
    assert config.cluster.pool_labels == {"gpu": "g1"}
    assert config.run.keep_best is True
    with pytest.raises(Exception):
        config.trainer.lr = 1.0  # frozen


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1e-5", "unknown config key 'trainer.lrr'"),
        ("trainr.lr=1e-5", "unknown config key 'trainr'"),
        ("grpo.group_size=four", "grpo.group_size: expected int"),
        ("grpo.group_size=2.5", "grpo.group_size: expected int"),
        ("run.keep_best=3", "run.keep_best: expected bool"),
        ("grpo.token_aggregation=mean", "grpo.token_aggregation: 'mean' is not one of"),
        ("policy.resources.pool=tpu", "policy.resources.pool"),
        ("trainer.lr", "must look like section.key=value"),
        ("trainer.lr.x=1", "trainer.lr: expected float"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(JobConfig, None, [override])


def test_malformed_yaml_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(JobConfig, bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(JobConfig, bad)
    bad.write_text("trainer: 3\n")
    with pytest.raises(ConfigError, match="trainer: expected a mapping"):
        load_config(JobConfig, bad)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="multiple of grpo.group_size"):
        load_config(JobConfig, None, ["grpo.group_size=3", "grpo.games_per_step=64"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("policy.num_replicas=0", "policy.num_replicas = 0 is out of range: it must be >= 1"),
        ("env.num_actors=0", "env.num_actors = 0 is out of range: it must be >= 1"),
        ("trainer.num_ranks=-1", "trainer.num_ranks = -1 is out of range: it must be >= 1"),
        ("run.steps=0", "run.steps = 0 is out of range: it must be >= 1"),
        ("run.keep_checkpoints=0", "run.keep_checkpoints = 0 is out of range: it must be >= 1"),
        ("trainer.lr=0", "trainer.lr = 0.0 is out of range: it must be > 0"),
        ("grpo.clip_eps=-0.2", "grpo.clip_eps = -0.2 is out of range: it must be > 0"),
        ("policy.call_timeout_s=0", "policy.call_timeout_s = 0.0 is out of range: it must be > 0"),
        ("env.resources.num_cpus=-1", "env.resources.num_cpus = -1.0 is out of range: it must be >= 0"),
        ("policy.temperature=-1", "policy.temperature = -1.0 is out of range: it must be >= 0.0"),
        ("trainer.min_lr_ratio=2", "trainer.min_lr_ratio = 2.0 is out of range: it must be in [0, 1]"),
        ("buffer.capacity_games=64", "buffer.capacity_games (64) is smaller than grpo.games_per_step"),
        ("chaos.targets=[trainer]", "chaos.targets: 'trainer' is not env, policy or one of"),
        ("chaos.targets=[policy-5]", "chaos.targets: 'policy-5' is not env, policy or one of ['env-0', 'policy-0']"),
    ],
)
def test_out_of_range_values_name_the_key(override, message):
    import re

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(JobConfig, None, [override])


def test_the_local_cluster_counts_gpus_unless_told():
    assert load_config(JobConfig).cluster.num_gpus == "auto"
    assert load_config(JobConfig, overrides=["cluster.num_gpus=2"]).cluster.num_gpus == 2
    with pytest.raises(ConfigError, match="cluster.num_gpus"):
        load_config(JobConfig, overrides=["cluster.num_gpus=many"])


def test_precision_settings_are_typed():
    config = load_config(JobConfig, overrides=["trainer.dtype=bfloat16", "grpo.tis_cap=2"])
    assert config.trainer.dtype == "bfloat16" and config.grpo.tis_cap == 2.0
    with pytest.raises(ConfigError, match="trainer.dtype"):
        load_config(JobConfig, overrides=["trainer.dtype=float16"])


def test_every_config_field_has_a_docstring():
    """The schema's promise: every field a YAML file can set says what it does (a string right after
    it), the job's sections and every registered env's own options (``env.options.<name>``) alike."""
    import ast
    import dataclasses
    import inspect
    import textwrap
    import typing

    from envs.registry import SPECS

    def documented(cls) -> set[str]:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        return {field.target.id for field, doc in zip(body, body[1:]) if isinstance(field, ast.AnnAssign)
                and isinstance(doc, ast.Expr) and isinstance(doc.value,
                    ast.Constant) and isinstance(doc.value.value, str)}

    from ray_forge.config.schema import SFTConfig

    missing, seen, todo = [], set(), [JobConfig, SFTConfig, *(spec.options for spec in SPECS.values())]
    while todo:
        cls = todo.pop()
        seen.add(cls)
        hints, names = typing.get_type_hints(cls), documented(cls)
        for field in dataclasses.fields(cls):
            if field.name not in names:
                missing.append(f"{cls.__name__}.{field.name}")
            if dataclasses.is_dataclass(hints[field.name]) and hints[field.name] not in seen:
                todo.append(hints[field.name])
    assert len(seen) >= 14 and not missing, missing


FREE = {"seed", "invalid_action_penalty"}
"""Numeric settings any value of which means something (a seed, a reward)."""


def test_every_numeric_setting_declares_its_bound_on_the_field():
    """Bounds sit on the fields themselves, so a renamed field keeps its check: every numeric field
    of both jobs' configs has one, but seeds and rewards."""
    import dataclasses
    import typing

    from ray_forge.config.schema import SFTConfig

    def unbounded(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from unbounded(hints[f.name], f"{prefix}{f.name}.")
            elif hints[f.name] in (int, float) and "bound" not in f.metadata and f.name not in FREE:
                yield prefix + f.name

    assert [*unbounded(JobConfig), *unbounded(SFTConfig)] == []
    with pytest.raises(ConfigError, match=r"grpo.group_size = 1 is out of range: it must be >= 2"):
        load_config(JobConfig, None, ["grpo.group_size=1"])
    with pytest.raises(ConfigError, match=r"data.eval_fraction = 1.0 is out of range: it must be in \[0, 1\)"):
        from ray_forge.config.schema import SFTConfig
        load_config(SFTConfig, None, ["data.eval_fraction=1"])
