"""TorchTitan Qwen3 + FSDP2 on gloo in Ray actors: 2 ranks train exactly like 1, and export HF weights."""

import asyncio
import dataclasses

import pytest
import torch

from ray_forge.actors.trainer import TrainerActor
from ray_forge.actors.trainer_group import TrainerGroup
from ray_forge.core.episode import Sample
import tiny_configs

pytestmark = pytest.mark.ray


def _samples(tokenizer, allowed):
    from envs.blackjack import BlackjackTextEnv

    prompts = [BlackjackTextEnv().reset(seed) for seed in range(40)]
    samples = []
    for i, prompt in enumerate(prompts):
        ids = tuple(tokenizer.encode(prompt, add_special_tokens=False))
        action = allowed[i % 2]
        samples.append(Sample.completion(ids, (action,), behaviour_logprobs=(-0.6 - 0.01 * i,),
                              advantage=1.0 if i % 3 else -1.5, policy_version=0, weight=1.0 + i % 2))
    return samples  # 40 rows: odd count per rank is not needed, but uneven splits are tested below


def _run(model_dir, world_size, samples, allowed, tmp_path):
    ranks = [TrainerActor.options(name=f"trainer-test{world_size}-{r}", num_cpus=0.5).remote(
        tiny_configs.trainer(lr=1e-3, micro_batch_size=8, num_ranks=world_size), model_dir=model_dir,
            grpo=tiny_configs.grpo(entropy_coef=0.01), total_steps=3, rank=r,
                allowed_token_ids=allowed) for r in range(world_size)]
    group = TrainerGroup(ranks, timeout_s=300)
    try:
        group.setup()
        stats = [asyncio.run(group.train_step(samples)) for _ in range(3)]
        out = tmp_path / f"ws{world_size}"
        asyncio.run(group.export_hf(str(out)))
        return stats, out / "model.safetensors"
    finally:
        group.shutdown()
        for r in ranks:
            import ray
            ray.kill(r)


def test_two_rank_fsdp_matches_one_rank(ray_cluster, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    allowed = sorted(tokenizer.convert_tokens_to_ids(["HIT", "STICK"]))
    samples = _samples(tokenizer, allowed)[:39]  # 39 rows: ranks get 20 and 19 (+ a padding row)
    one, path_one = _run(tiny_model_dir, 1, samples, allowed, tmp_path)
    two, path_two = _run(tiny_model_dir, 2, samples, allowed, tmp_path)
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
    assert one[0]["loss"] != pytest.approx(one[2]["loss"], abs=1e-6)  # it trained
    assert one[-1]["version"] == 3
    w1, w2 = load_file(str(path_one)), load_file(str(path_two))
    initial = load_file(f"{tiny_model_dir}/model.safetensors")
    assert set(w1) == set(w2) == set(initial)  # HF naming, every tensor
    # Adam moves a weight by about lr per step whatever the size of its gradient, so the few
    # weights with a ~0 gradient can differ by up to ~lr between two reduction orders. Everything
    # else must agree to float noise, far below what training changed.
    diffs = torch.cat([(w1[k] - w2[k]).abs().flatten() for k in w1])
    updates = torch.cat([(w1[k] - initial[k]).abs().flatten() for k in w1])
    print(f"update mean {updates.mean():.3g}; shard difference mean {diffs.mean():.3g}, max {diffs.max():.3g}, "
          f"{(diffs > 1e-5).sum().item()} of {diffs.numel()} above 1e-5")
    assert updates.mean() > 1e-4  # it trained (3 AdamW steps at lr 1e-3)
    assert diffs.mean() < 1e-4 * updates.mean()
    assert (diffs > 1e-5).float().mean() < 1e-3
    assert diffs.max() <= 3 * 1e-3  # never more than the 3 Adam steps could move a weight


def _ranks(model_dir, world_size, allowed, tag, **trainer):
    return [TrainerActor.options(name=f"trainer-{tag}-{r}", num_cpus=0.5).remote(
        tiny_configs.trainer(lr=1e-3, micro_batch_size=8, num_ranks=world_size, **trainer), model_dir=model_dir,
            grpo=tiny_configs.grpo(entropy_coef=0.01), total_steps=4, rank=r,
                allowed_token_ids=allowed) for r in range(world_size)]


def _weights(group, folder):
    from safetensors.torch import load_file

    asyncio.run(group.export_hf(str(folder)))
    return load_file(str(folder / "model.safetensors"))


def _stop(group, ranks):
    import ray

    group.shutdown()
    for r in ranks:
        ray.kill(r)


def test_the_loss_gets_from_a_head_at_sampled_positions_only_the_logprobs_a_full_forward_gives(ray_cluster,
                                                                                               tiny_model_dir):
    """The trainer applies its output head only where a loss is read (a hook inside the FSDP
    forward). Behaviour logprobs taken from its full-head scoring (``score``): the loss's own
    logprobs equal them, on rows with several sampled tokens, rows sharing a prompt, and more
    rows than one micro-batch. And rows of one input run one forward however the batch orders
    them: 6 states, each with 4 rows (2 answers, 2 advantage signs) scattered over the batch,
    cost 6 rows of forward in micro-batches of 4."""
    import ray
    from transformers import AutoTokenizer

    from envs.blackjack import BlackjackTextEnv

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tuple(tokenizer.encode(BlackjackTextEnv().reset(seed % 7), add_special_tokens=False)) for seed in range(12)]
    pairs = [(p, prompts[(i + 3) % 12][i % 4:i % 4 + 1 + i % 3]) for i, p in enumerate(prompts)]  # 1-3 tokens each
    rank = TrainerActor.options(num_cpus=0.5).remote(
        tiny_configs.trainer(lr=1e-3, micro_batch_size=4), model_dir=tiny_model_dir,
        grpo=tiny_configs.grpo(entropy_coef=0.01), total_steps=2, rank=0, allowed_token_ids=None, temperature=0.7)
    group = TrainerGroup([rank], timeout_s=300)
    states = sorted(set(prompts))[:6]
    scattered = [Sample.completion(states[i % 6], (7 + i // 6 % 2,), behaviour_logprobs=(-0.7,),
                                   advantage=1.0 if i // 12 else -1.0, policy_version=0) for i in range(24)]
    try:
        group.setup()
        scored = ray.get(rank.score.remote(pairs), timeout=300)
        samples = [Sample.completion(p, r, behaviour_logprobs=s.logprobs, advantage=1.0 if i % 2 else -1.0,
                                     policy_version=0) for i, ((p, r), s) in enumerate(zip(pairs, scored))]
        stats = asyncio.run(group.train_step(samples))
        shared = asyncio.run(group.train_step(scattered))
    finally:
        group.shutdown()
        ray.kill(rank)
    assert stats["logprob_diff"] < 1e-6 and stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6), stats
    assert stats["num_tokens"] == sum(len(r) for _, r in pairs) and stats["entropy"] > 0
    assert len(set(states)) == 6 and len({(s.token_ids, s.advantage) for s in scattered}) == 24
    assert shared["num_tokens"] == 24 and shared["forward_rows"] == 6, shared


def test_two_rank_checkpoint_resumes_bit_for_bit_and_a_nan_step_is_skipped(ray_cluster, tiny_model_dir, tmp_path):
    """Model and optimizer shards of 2 FSDP2 ranks through DCP: a fresh pair that loads them takes
    the next step exactly as the pair that wrote them. A NaN loss skips the update and no more."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    allowed = sorted(tokenizer.convert_tokens_to_ids(["HIT", "STICK"]))
    samples = _samples(tokenizer, allowed)[:39]
    folder = tmp_path / "ckpt"
    (folder / "trainer").mkdir(parents=True)
    ranks = _ranks(tiny_model_dir, 2, allowed, "a")
    group = TrainerGroup(ranks, timeout_s=300)
    try:
        group.setup()
        asyncio.run(group.train_step(samples))
        asyncio.run(group.save_checkpoint(str(folder)))
        assert sorted(p.name for p in (folder / "trainer").iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "rank-0.pt", "rank-1.pt"]  # sharded per rank
        continued = asyncio.run(group.train_step(samples))
        expected = _weights(group, tmp_path / "continued")
    finally:
        _stop(group, ranks)

    ranks = _ranks(tiny_model_dir, 2, allowed, "b")
    group = TrainerGroup(ranks, timeout_s=300)
    try:
        group.setup()
        assert asyncio.run(group.load_checkpoint(str(folder))) == 1
        resumed = asyncio.run(group.train_step(samples))
        got = _weights(group, tmp_path / "resumed")
        assert resumed == continued  # loss, statistics, lr and version: all equal
        assert all(torch.equal(got[k], expected[k]) for k in expected)

        poisoned = [dataclasses.replace(samples[0], behaviour_logprobs=(float("nan"),)), *samples[1:]]
        skipped = asyncio.run(group.train_step(poisoned))
        assert skipped["skipped_nonfinite"] == 1.0 and skipped["version"] == 3
        after_nan = _weights(group, tmp_path / "after_nan")
        assert all(torch.equal(after_nan[k], got[k]) for k in got)  # the update was skipped
        healthy = asyncio.run(group.train_step(samples))
        assert healthy["skipped_nonfinite"] == 0.0 and torch.isfinite(torch.tensor(healthy["loss"]))
    finally:
        _stop(group, ranks)


def test_the_moving_average_of_two_ranks_is_kept_checkpointed_and_becomes_the_weights(ray_cluster, tiny_model_dir,
                                                                                      tmp_path):
    """trainer.ema_decay=0.5 over two steps: the weights become 0.25 W0 + 0.25 W1 + 0.5 W2, and a
    pair that resumes from the checkpoint after step 1 ends on the same average, bit for bit."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    allowed = sorted(tokenizer.convert_tokens_to_ids(["HIT", "STICK"]))
    samples = _samples(tokenizer, allowed)[:39]
    folder = tmp_path / "ckpt"
    (folder / "trainer").mkdir(parents=True)
    ranks = _ranks(tiny_model_dir, 2, allowed, "ema-a", ema_decay=0.5)
    group = TrainerGroup(ranks, timeout_s=300)
    try:
        group.setup()
        w0 = _weights(group, tmp_path / "w0")
        asyncio.run(group.train_step(samples))
        asyncio.run(group.save_checkpoint(str(folder)))
        w1 = _weights(group, tmp_path / "w1")
        asyncio.run(group.train_step(samples))
        w2 = _weights(group, tmp_path / "w2")
        # A forward without backward (the job's sync check) leaves the root's parameters gathered.
        prompt = tuple(tokenizer.encode("Your sum is 14, hard. Dealer shows 10. HIT or STICK?", add_special_tokens=False))
        before = asyncio.run(group.score([(prompt, (allowed[0],))]))
        asyncio.run(group.use_average())
        average = _weights(group, tmp_path / "average")
        after = asyncio.run(group.score([(prompt, (allowed[0],))]))
        assert after != before  # the next forward computes with the average
    finally:
        _stop(group, ranks)
    for k in w0:
        assert torch.allclose(average[k], 0.25 * w0[k] + 0.25 * w1[k] + 0.5 * w2[k], atol=1e-7), k
    assert max((average[k] - w2[k]).abs().max() for k in w2) > 1e-4  # not just the last weights

    ranks = _ranks(tiny_model_dir, 2, allowed, "ema-b", ema_decay=0.5)
    group = TrainerGroup(ranks, timeout_s=300)
    try:
        group.setup()
        assert asyncio.run(group.load_checkpoint(str(folder))) == 1
        asyncio.run(group.train_step(samples))
        asyncio.run(group.use_average())
        resumed = _weights(group, tmp_path / "resumed")
        assert all(torch.equal(resumed[k], average[k]) for k in average)
    finally:
        _stop(group, ranks)
