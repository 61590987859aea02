"""bf16 on both sides, on a CPU that has bf16 instructions: a TorchTitan trainer in FSDP2 mixed
precision (bf16 compute, fp32 masters) and a bf16 vLLM engine, compared after a sync by the
job's own check; and fp32 on both sides for the same model, which must agree to 1e-4."""

import asyncio

import pytest
import torch

from envs.blackjack import ACTION_WORDS, render_state
from envs.blackjack.exact import all_states
from ray_forge import identity
from ray_forge.run import sync_check
import tiny_configs

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

BF16_TOLERANCE = 0.01
"""Largest logprob difference allowed between a bf16 engine and a bf16 trainer: the two round
differently (fused kernels, accumulation order). Measured on this CPU: see the README."""


def _has_bf16() -> bool:
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16") or caps.get("bf16"))


def _compare(ray_cluster, model_dir: str, dtype: str, name: str) -> dict:
    import ray

    from ray_forge.actors.policy import PolicyActor
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.weights import StoreSpec, WeightStore

    policy = PolicyActor.options(num_cpus=0.5).remote(
        tiny_configs.policy(kv_cache_mb=64, dtype=dtype), model_dir=model_dir, action_words=ACTION_WORDS)
    allowed = ray.get(policy.get_allowed_token_ids.remote(), timeout=300)
    rank = TrainerActor.options(num_cpus=0.5).remote(
        tiny_configs.trainer(lr=1e-3, dtype=dtype), model_dir=model_dir, grpo=tiny_configs.grpo(), total_steps=3, rank=0,
            allowed_token_ids=allowed)
    trainer = TrainerGroup([rank], timeout_s=300)
    store = WeightStore.create(StoreSpec(name=name, transport="shm", dtype=dtype))
    try:
        trainer.setup()
        asyncio.run(trainer.publish_weights(store.spec, 1))
        ray.get(policy.update_weights.remote(store.spec, 1), timeout=120)
        prompts = [render_state(s) for s in all_states()]
        return asyncio.run(sync_check.check(policy, identity.policy(0), trainer, prompts, seed=0,
                                            tolerance=BF16_TOLERANCE, timeout_s=120))
    finally:
        trainer.shutdown()
        store.destroy()
        ray.kill(rank)
        ray.kill(policy)


@pytest.mark.skipif(not _has_bf16(), reason="this CPU has no bfloat16 instructions (AVX512-BF16/AMX/ARM BF16): "
                                            "bf16 is refused here, see test_bf16_is_refused_without_the_instructions")
def test_bf16_engine_and_bf16_trainer_agree_within_the_stated_tolerance(ray_cluster, tiny_model_dir):
    row = _compare(ray_cluster, tiny_model_dir, "bfloat16", "precision-bf16")
    print("bf16 sync check:", row)
    assert row["sync_logprob_max_diff"] <= BF16_TOLERANCE
    assert row["sync_greedy_agreement"] >= 0.97  # near-ties may flip in bf16; most states must agree


def test_fp32_engine_and_fp32_trainer_agree_to_1e_4(ray_cluster, tiny_model_dir):
    row = _compare(ray_cluster, tiny_model_dir, "float32", "precision-fp32")
    assert row["sync_greedy_agreement"] == 1.0 and row["sync_logprob_max_diff"] <= 1e-4


def test_bf16_is_refused_without_the_instructions(monkeypatch):
    from ray_forge.models.devices import require_dtype

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"cpu_name": "old"})
    with pytest.raises(ValueError, match="trainer.dtype=bfloat16 needs a GPU or a CPU with bfloat16"):
        require_dtype("bfloat16", "cpu", "trainer.dtype")
    require_dtype("float32", "cpu", "trainer.dtype")  # fp32 is always fine
    require_dtype("bfloat16", "cuda", "trainer.dtype")


def test_bf16_is_refused_where_the_kernel_denies_amx_state(monkeypatch):
    """vLLM's bf16 attention uses AMX tiles where the CPU has them; a process the kernel has not
    granted their state dies of SIGILL in the first forward, so the engine must not start."""
    from ray_forge.models.devices import require_dtype

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"cpu_name": "spr", "amx_bf16": True, "amx_tile": True})
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    with pytest.raises(ValueError, match=r"policy.dtype=bfloat16: this CPU has AMX tiles.*set policy.dtype=float32"):
        require_dtype("bfloat16", "cpu", "policy.dtype")
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: True)
    require_dtype("bfloat16", "cpu", "policy.dtype")

