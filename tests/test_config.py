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
    assert config.grpo.games_per_step == config.grpo.prompts_per_step * config.grpo.samples_per_prompt
    registry.setup(config.env)  # its env's own options are valid too


def test_an_sft_config_is_as_strict_as_the_grpo_one():
    from ray_forge.config.schema import SFTConfig

    with pytest.raises(ConfigError, match="unknown config key 'data.batch'"):
        load_config(SFTConfig, CONFIGS / "sft_tools_tiny.yaml", ["data.batch=3"])
    with pytest.raises(ConfigError, match="data.batch_size = 0 is out of range"):
        load_config(SFTConfig, CONFIGS / "sft_tools_tiny.yaml", ["data.batch_size=0"])
    assert load_config(SFTConfig, CONFIGS / "sft_tools_tiny.yaml", ["trainer.lr=1e-3"]).trainer.lr == 1e-3
    with pytest.raises(ConfigError, match="trainer.ema_decay is a GRPO setting"):
        load_config(SFTConfig, CONFIGS / "sft_tools_tiny.yaml", ["trainer.ema_decay=0.9"])
    assert load_config(JobConfig, CONFIGS / "blackjack_tiny.yaml", ["trainer.ema_decay=0.9"]).trainer.ema_decay == 0.9


def test_dotted_overrides_are_typed():
    config = load_config(JobConfig, None, ["trainer.lr=3e-5", "grpo.samples_per_prompt=4", "policy.resources.num_cpus=2",
                                           "cluster.pool_labels={gpu: g1}", "run.keep_best=true"])
    assert config.trainer.lr == 3e-5 and isinstance(config.trainer.lr, float)
    assert config.grpo.samples_per_prompt == 4 and config.grpo.games_per_step == 4 * config.grpo.prompts_per_step
    assert config.policy.resources.num_cpus == 2.0
    assert config.cluster.pool_labels == {"gpu": "g1"}
    assert config.run.keep_best is True
    with pytest.raises(Exception):
        config.trainer.lr = 1.0  # frozen


def test_a_trainer_may_run_more_torch_threads_than_the_cpus_it_holds():
    default = load_config(JobConfig, None, ["trainer.resources.num_cpus=0.75"])
    more = load_config(JobConfig, None, ["trainer.resources.num_cpus=0.75", "trainer.resources.threads=2"])
    assert (default.trainer.resources.torch_threads, more.trainer.resources.torch_threads) == (1, 2)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1e-5", "unknown config key 'trainer.lrr'"),
        ("trainr.lr=1e-5", "unknown config key 'trainr'"),
        ("grpo.samples_per_prompt=four", "grpo.samples_per_prompt: expected int"),
        ("grpo.prompts_per_step=2.5", "grpo.prompts_per_step: expected int"),
        ("run.keep_best=3", "run.keep_best: expected bool"),
        ("grpo.token_aggregation=mean", "grpo.token_aggregation: 'mean' is not one of"),
        ("policy.resources.pool=tpu", "policy.resources.pool"),
        ("trainer.lr", "must look like section.key=value"),
        ("trainer.lr.x=1", "trainer.lr: expected float"),
        ("policy.resources.threads=2", "policy.resources.threads is for the trainer and the reference"),
        ("env.resources.threads=2", "env.resources.threads is for the trainer and the reference"),
        ("policy.chat_prompts=true env.episode.mode=sequence", "policy.chat_prompts is for text prompts"),
        ("policy.system_prompt=hi", "policy.system_prompt needs policy.chat_prompts=true"),
        ("grpo.center_actions=true", "grpo.center_actions needs policy.constrain_to_actions=true"),
        ("policy.draw_from_distribution=true", "policy.draw_from_distribution=true draws one-token answers, and "
                                               "policy.max_tokens=1024 asks for longer ones"),
        ("policy.draw_from_distribution=true policy.max_tokens=1", "policy.constrain_to_actions=false has none"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(JobConfig, None, override.split())


def test_a_constraint_to_the_action_words_of_an_env_without_them_is_refused():
    from ray_forge.core.actions import require_action_words

    with pytest.raises(ConfigError, match="policy.constrain_to_actions=true needs an env with action words; env 'code'"):
        require_action_words("code", None)
    require_action_words("blackjack", ("hit", "stick"))


def test_the_demo_s_draws_are_refused_once_its_answers_are_longer_or_unconstrained():
    load_config(JobConfig, CONFIGS / "blackjack_tiny.yaml")
    with pytest.raises(ConfigError, match="policy.max_tokens=2 asks for longer ones"):
        load_config(JobConfig, CONFIGS / "blackjack_tiny.yaml", ["policy.max_tokens=2"])
    with pytest.raises(ConfigError, match="policy.constrain_to_actions=false has none"):
        load_config(JobConfig, CONFIGS / "blackjack_tiny.yaml", ["policy.constrain_to_actions=false"])


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


def test_a_buffer_smaller_than_a_step_and_a_chaos_target_that_is_no_actor_are_refused():
    with pytest.raises(ConfigError, match=r"buffer.capacity_games \(100\) is smaller than a step's 128 games"):
        load_config(JobConfig, None, ["grpo.prompts_per_step=16", "grpo.samples_per_prompt=8",
                                      "buffer.capacity_games=100"])
    assert load_config(JobConfig, None, ["grpo.prompts_per_step=16", "buffer.capacity_games=128"]).grpo.games_per_step == 128
    with pytest.raises(ConfigError, match=r"chaos.targets: 'policy-1' is not env, policy or one of"):
        load_config(JobConfig, None, ["chaos.targets=[policy-1]"])
    assert load_config(JobConfig, None, ["chaos.targets=[policy-1]", "policy.num_replicas=2"]).chaos.targets == (
        "policy-1",)


@pytest.mark.parametrize("old, new", [
    ("grpo.group_size=8", "grpo.group_size is now grpo.samples_per_prompt"),
    ("grpo.games_per_step=64", "grpo.games_per_step is now grpo.prompts_per_step (games per step = prompts_per_step "
                               "x samples_per_prompt)"),
    ("run.eval_mc_games=100", "run.eval_mc_games is now env.options.blackjack.mc_games"),
    ("env.openenv={}", "env.openenv is now env.options.openenv"),
])
def test_an_old_key_fails_in_one_line_naming_the_new_one(old, new):
    with pytest.raises(ConfigError) as err:
        load_config(JobConfig, None, [old])
    assert str(err.value) == new


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
        ("buffer.capacity_games=64", "buffer.capacity_games (64) is smaller than a step's 512 games"),
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
    with pytest.raises(ConfigError, match=r"grpo.samples_per_prompt = 1 is out of range: it must be >= 2"):
        load_config(JobConfig, None, ["grpo.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match=r"data.eval_fraction = 1.0 is out of range: it must be in \[0, 1\)"):
        from ray_forge.config.schema import SFTConfig
        load_config(SFTConfig, None, ["data.eval_fraction=1"])


def test_a_config_with_only_a_model_and_an_env_resolves_to_what_the_readme_shows():
    """Defaults for a 1-8B model: bf16, long completions, prompts x samples, GPUs where there are any."""
    import yaml

    from ray_forge.config import to_dict

    config = load_config(JobConfig, None, ["model.path=/models/Qwen3-1.7B", "env.name=blackjack"])
    assert (config.policy.dtype, config.trainer.dtype, config.policy.max_tokens) == ("bfloat16", "bfloat16", 1024)
    assert not config.policy.constrain_to_actions and config.grpo.games_per_step == 64 * 8
    assert config.pools(gpus=True)["gpu"][0][1].num_gpus == 1.0 and config.pools(gpus=False)["gpu"][0][1].num_gpus == 0
    assert all(res.num_gpus == 0 for _, res in config.pools(gpus=True)["cpu"])
    shown = yaml.safe_dump(to_dict(config), sort_keys=False, width=110)
    assert "```yaml\n" + shown + "```" in (CONFIGS.parent.parent / "README.md").read_text()


def test_the_demo_config_sets_the_tiny_engine_and_trainer_the_tests_use():
    """The tiny model's settings sit in blackjack_tiny.yaml, not in the schema's defaults; the
    tests' own copy of them (tests/tiny_configs.py) is the same."""
    from tiny_configs import TINY_POLICY, TINY_TRAINER

    demo = load_config(JobConfig, CONFIGS / "blackjack_tiny.yaml")
    assert {key: getattr(demo.policy, key) for key in TINY_POLICY} == TINY_POLICY
    assert (demo.trainer.dtype, demo.trainer.micro_batch_size) == (TINY_TRAINER["dtype"], TINY_TRAINER["micro_batch_size"])
    defaults = JobConfig()
    assert any(getattr(defaults.policy, key) != value for key, value in TINY_POLICY.items())
