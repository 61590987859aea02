"""Local model creation and clear errors for bad model folders (no Ray)."""

import json

import pytest

from ray_forge.models.tiny import ModelError, check_model_dir


def test_tiny_model_is_a_normal_hf_folder(tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "qwen3" and config.tie_word_embeddings is False
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode("Your sum is 14, hard. Dealer shows A. HIT or STICK?", add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids and len(ids) == 15
    assert len(tokenizer.encode("HIT", add_special_tokens=False)) == 1
    assert config.vocab_size == len(tokenizer)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    with pytest.raises(ModelError, match="no config.json"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(ModelError, match="'mixtral'; ray_forge trains dense decoders of these types: qwen3, llama"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ModelError, match="safetensors"):
        check_model_dir(tmp_path)


def test_bpe_tokenizer_round_trips_code_exactly(tmp_path):
    """The bpe option: byte-level, so text the corpus never showed (indentation, tabs, unicode)
    decodes back exactly; the special tokens and eos are those of the word-level tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    from ray_forge.config.schema import TinyModelConfig
    from ray_forge.models.tiny import SPECIAL_TOKENS, make_tiny_qwen3

    corpus = ["Write a function `digit_sum(n: int) -> int`.\nAnswer with the function in a ```python block.",
              "digit_sum(1234) == 10", "digit_sum(0) == 0"]
    shape = TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                            tokenizer="bpe", bpe_vocab_size=300)
    folder = make_tiny_qwen3(tmp_path / "bpe", corpus, shape)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == list(SPECIAL_TOKENS)
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert config.eos_token_id == 2 and config.vocab_size == len(tokenizer)
    # 3 special + 256 bytes, then merges learned from the corpus, up to bpe_vocab_size.
    assert 3 + 256 < len(tokenizer) <= 300
    code = "def digit_sum(n: int) -> int:\n    total = 0\n\twhile n:  # é\n        total, n = total + n % 10, n // 10\n    return total\n"
    ids = tokenizer.encode(code, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == code
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == code
    # Merges were learned: a corpus phrase takes fewer tokens than its bytes.
    assert len(tokenizer.encode("digit_sum(1234) == 10", add_special_tokens=False)) < len("digit_sum(1234) == 10") / 2


def test_unknown_tokenizer_kind_is_an_error():
    from ray_forge.models.tiny import build_tokenizer

    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        build_tokenizer(["a b"], "sentencepiece")
