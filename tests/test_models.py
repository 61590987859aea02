"""Local model creation and clear errors for bad model folders (no Ray)."""

import json

import pytest

from ray_forge.models import ModelError, check_model_dir


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
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match="trains Qwen3"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ModelError, match="safetensors"):
        check_model_dir(tmp_path)
