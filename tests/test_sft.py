"""Supervised fine-tuning data and loss: conversations rendered by the rollouts' sequence builder,
loss on assistant tokens only, packing that changes nothing, and bad files named."""

from __future__ import annotations

import json

import pytest
import torch

from envs.code.arithmetic import Arithmetic, Mix, demonstrations
from ray_forge.config.schema import TinyModelConfig
from ray_forge.core import sft
from ray_forge.core.algorithm import sft_loss
from ray_forge.core.batch import collate_packed
from ray_forge.core.chat import ChatFormat
from ray_forge.core.episode import Turn
from ray_forge.core.sequence import SequenceBuilder

SHAPE = TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                        max_position_embeddings=512, tokenizer="bpe", bpe_vocab_size=512, split_digits=True)


@pytest.fixture(scope="module")
def conversations() -> list[sft.Conversation]:
    tasks, _ = Arithmetic(train=24, held_out=1).splits()
    return [sft.Conversation(c["messages"], c["tools"]) for c in demonstrations(tasks, Mix(tool=0.5, broken=0.2), 0)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, conversations) -> str:
    from jobs.sft import corpus_of
    from ray_forge.models.tiny import make_tiny_qwen3

    return str(make_tiny_qwen3(tmp_path_factory.mktemp("sft") / "tiny", corpus_of(conversations), SHAPE, chat=True))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_the_loss_is_on_the_assistant_tokens_only(tokenizer, conversations):
    tool_use = next(c for c in conversations if len(c.messages) == 4)
    [row] = sft.render(tokenizer, tool_use)
    trained = tokenizer.decode([t for t, m in zip(row.token_ids, row.loss_mask) if m], skip_special_tokens=False)
    call, _, answer = tool_use.messages[1:]
    code = call["tool_calls"][0]["function"]["arguments"]["code"]
    # The tool call up to its closing tag (where the engine stops), then the answer and its end of turn.
    assert trained == (f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>'
                       f'{answer["content"]}<|im_end|>')
    untrained = tokenizer.decode([t for t, m in zip(row.token_ids, row.loss_mask) if not m], skip_special_tokens=False)
    for text in ("# Tools", tool_use.messages[0]["content"], f"<tool_response>\n{answer['content']}\n</tool_response>"):
        assert text in untrained


def test_a_rendered_conversation_is_the_sequence_a_rollout_builds(tokenizer, conversations):
    """The same ids as the rollouts' builder makes of the same turns, sampled one by one."""
    chat = ChatFormat(tokenizer, conversations[0].tools)
    for conversation in conversations[:6]:
        [row] = sft.render(tokenizer, conversation)
        messages = conversation.messages
        builder = SequenceBuilder(chat, messages[:1])
        for i, message in enumerate(messages[1:], start=1):
            if message["role"] == "tool":
                builder.add_env_turn([message])
                continue
            text = (f'<tool_call>{json.dumps(message["tool_calls"][0]["function"])}</tool_call>'
                    if message.get("tool_calls") else message["content"] + "<|im_end|>")
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            builder.add_model_turn(Turn(builder.prompt(), ids, (0.0,) * len(ids), 0), chat.decode(ids))
        [segment] = builder.segments()
        assert (row.token_ids, row.loss_mask) == (segment.token_ids, segment.loss_mask)


def _titan(model_dir: str):
    from ray_forge.models.decoder import build_decoder

    torch.manual_seed(0)
    model, _ = build_decoder(model_dir)
    return model


def _loss_and_grads(model, packed: list[sft.Packed]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    batch = collate_packed(packed)
    logits = model(batch.inputs_BT, positions=batch.positions_BT, attention_masks=batch.attention_B1TT)
    loss = sft_loss(logits, batch.targets_BT, batch.mask_BT, sum(p.loss_tokens for p in packed))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_and_unpacked_batches_give_the_same_loss_and_gradient(model_dir, tokenizer, conversations):
    model = _titan(model_dir)
    rows = [row for c in conversations for row in sft.render(tokenizer, c)]
    packed = sft.pack(rows, 512)
    alone = sft.pack(rows, 512, together=False)
    assert len(packed) < len(alone) == len(rows)
    assert sum(p.loss_tokens for p in packed) == sum(p.loss_tokens for p in alone) == sum(sum(r.loss_mask) for r in rows)
    packed_loss, packed_grads = _loss_and_grads(model, packed)
    alone_loss, alone_grads = _loss_and_grads(model, alone)
    assert packed_loss == pytest.approx(alone_loss, rel=1e-6)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packing_without_the_document_mask_would_change_the_loss(model_dir, tokenizer, conversations):
    """The check above can fail: the same packed rows with plain causal attention differ."""
    model = _titan(model_dir)
    rows = [row for c in conversations for row in sft.render(tokenizer, c)]
    packed = sft.pack(rows, 512)
    batch = collate_packed(packed)
    normalizer = sum(p.loss_tokens for p in packed)
    with torch.no_grad():
        masked = sft_loss(model(batch.inputs_BT, positions=batch.positions_BT, attention_masks=batch.attention_B1TT),
                          batch.targets_BT, batch.mask_BT, normalizer)
        leaking = sft_loss(model(batch.inputs_BT), batch.targets_BT, batch.mask_BT, normalizer)
    assert abs(masked.item() - leaking.item()) > 100 * 1e-6 * masked.item()  # 100x the tolerance above


def test_a_row_longer_than_the_packed_width_is_refused(tokenizer, conversations):
    [row] = sft.render(tokenizer, conversations[0])
    with pytest.raises(sft.DataError, match="longer than data.max_tokens"):
        sft.pack([row], len(row.token_ids) - 1)


def test_batches_are_fixed_by_the_seed_and_the_step():
    assert sft.batch_of(10, 4, 3, 0) == sft.batch_of(10, 4, 3, 0)
    epoch = sft.batch_of(10, 5, 1, 0) + sft.batch_of(10, 5, 2, 0)
    assert sorted(epoch) == list(range(10))  # an epoch shows every conversation once
    assert sft.batch_of(10, 5, 3, 0) != sft.batch_of(10, 5, 1, 0)  # the next epoch is shuffled anew


@pytest.mark.parametrize("line, error", [
    ("not json", "not JSON"),
    ('{"messages": []}', "at least one message"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "needs a role"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "starts with the assistant"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "tools": 3}',
     "'tools' must be a list"),
])
def test_a_malformed_conversation_is_named(tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
                    + line + "\n")
    with pytest.raises(sft.DataError, match=error) as err:
        sft.load_conversations(path)
    assert f"{path}:2" in str(err.value)


def test_conversations_read_from_parquet(tmp_path, conversations):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": json.loads(json.dumps(c.messages, default=str)), "tools": json.dumps(c.tools)}
            for c in conversations[:3]]
    for row in rows:  # Parquet cannot hold the arguments' free-form objects: datasets keep them as JSON text
        for message in row["messages"]:
            for call in message.get("tool_calls", []):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    path = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = sft.load_conversations(path)
    assert [c.tools for c in loaded] == [c.tools for c in conversations[:3]]
    assert [m["content"] for m in loaded[0].messages] == [m["content"] for m in conversations[0].messages]
