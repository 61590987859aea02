"""Multi-turn episodes as one token sequence: masks, templates, drift, and the loss they give."""

import json

import pytest
import torch

from ray_forge.core.algorithm import grpo_loss, loss_normalizer, token_logprobs_and_entropy
from ray_forge.core.batch import collate
from ray_forge.core.chat import ChatFormat, ChatTemplateError, parse_tool_calls
from ray_forge.core.episode import Sample, Turn
from ray_forge.core.sequence import SequenceBuilder, TemplateRewrite
from ray_forge.models.tiny import build_tokenizer

CORPUS = ["x = 41", "print(x + 1)", "hello world", "The answer is 42."] * 20
TOOLS = [{"type": "function", "function": {"name": "python", "description": "run code", "parameters": {}}}]

# Qwen3's own rule, in its format: an answer's reasoning is dropped from the turns before the
# last user query, so adding a user turn rewrites the earlier assistant turn.
REWRITING_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}"
    "{% if loop.index0 > ns.last %}{{ m.content }}{% else %}{{ m.content.split('</think>')[-1] }}{% endif %}"
    "<|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


# Qwen3's other rule: the last assistant turn after the query gets a reasoning block, empty when
# the model wrote none; once a tool result follows, that turn is rendered without it.
LAST_TURN_THINKS_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}"
    "{% if loop.last %}<think>{{ '\\n' }}{{ '\\n' }}</think>{{ '\\n' }}{{ '\\n' }}{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif m.role == 'tool' %}<|im_start|>user{{ '\\n' }}<tool_response>{{ m.content }}</tool_response><|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, "bpe", 400, chat=True)


def sampled(tok, builder: SequenceBuilder, text: str, version: int = 3) -> Turn:
    ids = tuple(tok.encode(text, add_special_tokens=False))
    return Turn(builder.prompt(), ids, tuple(-0.1 * (i + 1) for i in range(len(ids))), version,
                token_versions=(version,) * len(ids))


def play_tool_episode(tok, chat, calls: int = 3):
    """A model that calls the python tool ``calls`` times, then answers; returns the builder and
    every sampled turn."""
    builder = SequenceBuilder(chat, [{"role": "user", "content": "What is x + 1?"}])
    turns = []
    for k in range(calls):
        call = json.dumps({"name": "python", "arguments": {"code": f"x = {40 + k}\nprint(x + 1)"}})
        turn = sampled(tok, builder, f"Let me run it.<tool_call>{call}</tool_call>", version=k)
        builder.add_model_turn(turn, chat.decode(turn.response_ids))
        turns.append(turn)
        assert builder.add_env_turn([{"role": "tool", "name": "python", "content": f"{41 + k}"}])
    answer = sampled(tok, builder, "The answer is 42.<|im_end|>", version=calls)
    builder.add_model_turn(answer, chat.decode(answer.response_ids))
    return builder, turns + [answer]


def test_the_mask_covers_exactly_the_sampled_tokens_and_tool_output_has_no_loss(tok):
    chat = ChatFormat(tok, TOOLS)
    builder, turns = play_tool_episode(tok, chat)
    [segment] = builder.segments()
    ids, mask = segment.token_ids, segment.loss_mask
    trained = [t for t, m in zip(ids, mask) if m]
    assert trained == [t for turn in turns for t in turn.response_ids]
    assert segment.logprobs == tuple(lp for turn in turns for lp in turn.logprobs)
    assert segment.token_versions == tuple(v for turn in turns for v in turn.versions())
    # Every sampled turn sits in the sequence exactly where it was sampled: its prompt is the prefix.
    for turn in turns:
        start = len(turn.prompt_ids)
        assert ids[:start] == turn.prompt_ids and ids[start:start + len(turn.response_ids)] == turn.response_ids
    given = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
    for k in range(3):
        assert f"<tool_response>\n{41 + k}\n</tool_response>" in given
    assert "The answer" not in given and "Let me run it" not in given
    # The engine stopped at </tool_call>: the template's end of turn follows, with no loss.
    close = ids.index(chat.stops.ids[0])
    assert ids[close + 1] == chat.end_of_turn and mask[close + 1] == 0


def test_consecutive_tool_messages_and_an_observation_append_without_a_new_segment(tok):
    chat = ChatFormat(tok, TOOLS)
    builder = SequenceBuilder(chat, [{"role": "user", "content": "go"}])
    call = '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
    turn = sampled(tok, builder, call + call)
    builder.add_model_turn(turn, chat.decode(turn.response_ids))
    assert builder.add_env_turn([{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}])
    turn = sampled(tok, builder, "hello<|im_end|>")
    builder.add_model_turn(turn, chat.decode(turn.response_ids))
    assert builder.add_env_turn([{"role": "user", "content": "again"}])
    turn = sampled(tok, builder, "world<|im_end|>")
    builder.add_model_turn(turn, chat.decode(turn.response_ids))
    assert builder.num_segments == 1 and sum(builder.segments()[0].loss_mask) == sum(
        len(tok.encode(t, add_special_tokens=False)) for t in (call + call, "hello<|im_end|>", "world<|im_end|>"))


def test_a_template_that_rewrites_earlier_turns_is_detected(tok):
    tok = build_tokenizer(CORPUS, "bpe", 400, chat=True)
    tok.chat_template = REWRITING_TEMPLATE
    chat = ChatFormat(tok)
    builder = SequenceBuilder(chat, [{"role": "user", "content": "hi"}])
    turn = sampled(tok, builder, "<think>x = 41</think>hello<|im_end|>")
    builder.add_model_turn(turn, chat.decode(turn.response_ids))
    assert builder.add_env_turn([{"role": "user", "content": "again"}]) is False
    second = sampled(tok, builder, "world<|im_end|>")
    # The new segment starts from the template's own rendering: the reasoning is gone from it.
    assert "x = 41" not in tok.decode(list(second.prompt_ids), skip_special_tokens=False)
    builder.add_model_turn(second, chat.decode(second.response_ids))
    assert builder.num_segments == 2
    first, last = builder.segments()
    assert first.token_ids[-len(turn.response_ids):] == turn.response_ids
    assert last.token_ids == second.prompt_ids + second.response_ids
    assert sum(last.loss_mask) == len(second.response_ids)

    strict = SequenceBuilder(chat, [{"role": "user", "content": "hi"}], strict=True)
    turn = sampled(tok, strict, "<think>x = 41</think>hello<|im_end|>")
    strict.add_model_turn(turn, chat.decode(turn.response_ids))
    with pytest.raises(TemplateRewrite, match="model turn 1: the chat template renders the earlier turns"):
        strict.add_env_turn([{"role": "user", "content": "again"}])


def test_trained_ids_are_the_sampled_ones_where_decoding_and_encoding_again_changes_them(tok):
    chat = ChatFormat(tok, TOOLS)
    builder = SequenceBuilder(chat, [{"role": "user", "content": "hi"}])
    # "hello" spelled one byte at a time: a sampling the tokenizer would never produce from text.
    odd = tuple(tok.convert_tokens_to_ids(list("hello"))) + (chat.end_of_turn,)
    assert tuple(tok.encode(chat.decode(odd) + "<|im_end|>", add_special_tokens=False)) != odd
    turn = Turn(builder.prompt(), odd, (-0.5,) * len(odd), 0, token_versions=(0,) * len(odd))
    builder.add_model_turn(turn, chat.decode(odd))
    builder.add_env_turn([{"role": "user", "content": "more"}])
    again = sampled(tok, builder, "world<|im_end|>")
    builder.add_model_turn(again, chat.decode(again.response_ids))
    [segment] = builder.segments()
    trained = tuple(t for t, m in zip(segment.token_ids, segment.loss_mask) if m)
    assert trained == odd + again.response_ids
    assert again.prompt_ids[len(turn.prompt_ids):len(turn.prompt_ids) + len(odd)] == odd


def test_tool_calls_are_parsed_and_broken_ones_say_why():
    ok, bad_json, bad_shape, cut = parse_tool_calls(
        '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
        '<tool_call>{"name": python}</tool_call><tool_call>[1, 2]</tool_call><tool_call>{"name": "py')
    assert ok.name == "python" and ok.arguments == {"code": "1"} and ok.error is None
    assert "not valid JSON" in bad_json.error and "must be" in bad_shape.error and "cut off" in cut.error


def test_a_model_folder_s_own_template_is_used(tmp_path):
    from ray_forge.actors.launch import chat_tokenizer

    tok = build_tokenizer(CORPUS, "bpe", 400, chat=True)
    tok.chat_template = "{% for m in messages %}<|im_start|>FOLDER {{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}" \
                        "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
    tok.save_pretrained(tmp_path)
    chat = ChatFormat(chat_tokenizer(str(tmp_path)))
    text = chat.tokenizer.decode(chat.render([{"role": "user", "content": "hi"}], True), skip_special_tokens=False)
    assert text == "<|im_start|>FOLDER user: hi<|im_end|><|im_start|>assistant"
    plain = build_tokenizer(CORPUS, "bpe", 400)  # no chat template, no chat tokens
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        chat_tokenizer(str(tmp_path / "plain"))


def test_one_sequence_gives_the_loss_and_gradient_of_its_turns_as_prefix_samples(tok):
    """fp32 on CPU, to 1e-6 relative: an episode trained as one row equals its turns trained as
    separate samples whose prompts are the whole token prefix (token-mean aggregation)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    chat = ChatFormat(tok, TOOLS)
    builder, turns = play_tool_episode(tok, chat, calls=3)
    [segment] = builder.segments()
    whole = Sample.of_segment(segment, advantage=0.8)
    per_turn = [Sample.completion(t.prompt_ids, t.response_ids, behaviour_logprobs=t.logprobs, advantage=0.8,
                                  policy_version=0) for t in turns]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=1024)).float()

    def loss_and_grad(samples):
        model.zero_grad()
        batch = collate(samples)
        logprobs, entropy = token_logprobs_and_entropy(model(batch.inputs_BT).logits, batch.targets_BT)
        logprobs = torch.where(batch.mask_BT > 0, logprobs, torch.zeros_like(logprobs))
        terms = grpo_loss(logprobs, batch.behaviour_logprobs_BT, batch.advantages_B, batch.mask_BT, clip_eps=0.2,
                          entropy_BT=entropy, entropy_coef=0.01,
                          normalizer=loss_normalizer(batch.mask_BT, batch.weights_B, "token-mean"))
        terms.loss.backward()
        return terms.loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    loss_one, grad_one = loss_and_grad([whole])
    loss_many, grad_many = loss_and_grad(per_turn)
    assert loss_one == pytest.approx(loss_many, rel=1e-6)
    assert torch.allclose(grad_one, grad_many, rtol=1e-5, atol=1e-7) and grad_one.abs().sum() > 0
    assert len(whole.token_ids) < sum(len(s.token_ids) for s in per_turn)


def test_a_template_that_renders_the_last_turn_its_own_way_still_appends_tool_turns(tok):
    """Qwen3 gives the last assistant turn an empty reasoning block and drops it once a tool result
    follows: not a rewrite of anything the model wrote, so a tool episode stays one segment."""
    tok = build_tokenizer(CORPUS, "bpe", 400, chat=True)
    tok.chat_template = LAST_TURN_THINKS_TEMPLATE
    chat = ChatFormat(tok, TOOLS)
    builder, turns = play_tool_episode(tok, chat, calls=3)
    [segment] = builder.segments()
    assert [t for t, m in zip(segment.token_ids, segment.loss_mask) if m] == [t for u in turns for t in u.response_ids]
    # What the engine is given after a tool result is the template's own rendering of it.
    last = turns[-1].prompt_ids
    assert tok.decode(list(last), skip_special_tokens=False).endswith(
        "<tool_response>43</tool_response><|im_end|>\n<|im_start|>assistant\n")
