"""The real vLLM engine in-process: samples with exact behaviour logprobs, in-place weight reloads,
greedy parity with the trainer's TorchTitan model, and garbage output handled as a penalty."""

import pytest
import torch

from envs.blackjack import ACTION_WORDS, BlackjackTextEnv
from ray_forge.actors.policy import VLLMPolicy
from ray_forge.grpo_config import GRPOConfig, PolicyConfig, TrainerConfig

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    engine = VLLMPolicy(model_dir=tiny_model_dir, config=PolicyConfig(kv_cache_mb=64), action_words=ACTION_WORDS)
    yield engine
    engine.shutdown()


def _prompts(n):
    return [BlackjackTextEnv().reset(seed) for seed in range(n)]


def test_generate_returns_ids_logprobs_and_version(policy):
    prompts = _prompts(64)
    out = policy.generate(prompts)
    assert len(out) == 64
    for prompt, completion in zip(prompts, out):
        assert completion.prompt_ids == tuple(policy.tokenizer.encode(prompt, add_special_tokens=False))
        assert len(completion.response_ids) == 1 and completion.response_ids[0] in policy.allowed_ids
        assert completion.text.strip() in ACTION_WORDS
        assert completion.logprobs[0] < 0 and completion.policy_version == 0


def test_behaviour_logprobs_are_over_the_restricted_actions(policy, tiny_model_dir):
    """The trainer renormalises over the action tokens; the engine must report the same number."""
    from transformers import AutoModelForCausalLM

    from ray_forge.grpo import token_logprobs_and_entropy

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    out = policy.generate(_prompts(16))
    for c in out:
        with torch.no_grad():
            logits = hf(torch.tensor([c.prompt_ids])).logits[:, -1:]
        lp, _ = token_logprobs_and_entropy(logits, torch.tensor([[c.response_ids[0]]]), torch.tensor(policy.allowed_ids))
        assert c.logprobs[0] == pytest.approx(lp.item(), abs=1e-4)


@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_weight_update_in_place_matches_the_trainer(policy, tiny_model_dir, ray_cluster, transport):
    """Train with TorchTitan (a Ray actor, 1 rank, gloo), put its weights in the store, have the
    vLLM worker pull them in place, and compare: vLLM's greedy action equals the trainer model's
    argmax over the action tokens, and its sampling logprobs equal the trainer's."""
    import asyncio

    import ray

    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.episode import Sample
    from ray_forge.trainer_group import TrainerGroup
    from ray_forge.weights import StoreSpec, WeightStore

    rank = TrainerActor.options(num_cpus=0.5).remote(
        model_dir=tiny_model_dir, trainer=TrainerConfig(lr=3e-3), grpo=GRPOConfig(), total_steps=5,
        rank=0, world_size=1, allowed_token_ids=policy.allowed_ids)
    trainer = TrainerGroup([rank], timeout_s=300)
    store = WeightStore.create(StoreSpec(name=f"vllm-test-{transport}", transport=transport, bucket_bytes=2**17))  # several buckets
    try:
        trainer.setup()
        # Version 1 is the untrained model, so each transport starts from the same engine state.
        asyncio.run(trainer.publish_weights(store.spec, 1))
        policy.update_weights(store.spec, 1)
        prompts = _prompts(360)
        before = [c.text for c in policy.generate(prompts, greedy=True)]
        hit = policy.tokenizer.convert_tokens_to_ids("HIT")
        samples = [Sample(token_ids=c.prompt_ids + (hit,), prompt_len=len(c.prompt_ids),
                          behaviour_logprobs=(-0.7,), advantage=1.0, policy_version=0)
                   for c in policy.generate(prompts)]
        for _ in range(5):
            asyncio.run(trainer.train_step(samples))
        asyncio.run(trainer.publish_weights(store.spec, 5))
        assert store.versions() == [1, 5] and len(store.manifest(5).buckets) > 1
        seconds = policy.update_weights(store.spec, 5)
        assert seconds < 30 and policy.get_version() == 5
        after = policy.generate(prompts, greedy=True)
        assert [c.text for c in after] != before  # the weights changed what the engine does
        assert all(c.policy_version == 5 for c in after)
        logits = ray.get(rank.logits.remote([list(c.prompt_ids) for c in after]))  # same-length prompts
        for c, row in zip(after, logits):
            best = max(policy.allowed_ids, key=lambda t: row[-1, t].item())
            assert c.response_ids[0] == best
        # Behaviour logprobs after the sync equal the trainer's (so on-policy ratios are 1).
        sampled = policy.generate(prompts[:32])
        rows = ray.get(rank.logits.remote([list(c.prompt_ids) for c in sampled]))
        for c, row in zip(sampled, rows):
            expected = torch.log_softmax(row[-1, policy.allowed_ids], -1)[policy.allowed_ids.index(c.response_ids[0])]
            assert c.logprobs[0] == pytest.approx(expected.item(), abs=1e-4)
    finally:
        trainer.shutdown()
        ray.kill(rank)
        store.destroy()


def test_garbage_model_output_is_a_penalised_game(tiny_model_dir):
    """Unconstrained, a random model emits arbitrary words: games end with the penalty, nothing hangs."""
    engine = VLLMPolicy(model_dir=tiny_model_dir, action_words=ACTION_WORDS,
                        config=PolicyConfig(constrain_to_actions=False, max_tokens=3, kv_cache_mb=64))
    try:
        env = BlackjackTextEnv(invalid_action_penalty=-1.5)
        results = []
        for seed, completion in zip(range(64), engine.generate(_prompts(64))):
            env.reset(seed)
            results.append(env.step(completion.text))
        invalid = [r for r in results if r.info.get("error") == "invalid action"]
        assert invalid, "a random model should produce some unparseable actions"
        assert all(r.done and r.reward == -1.5 for r in invalid)
    finally:
        engine.shutdown()
