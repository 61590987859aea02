"""Make a tiny Qwen3 locally (nothing is downloaded) and check local HF checkpoints.

The tiny model is a normal Hugging Face folder: ``config.json``, ``model.safetensors`` and a
tokenizer trained on the env's texts (word-level, or byte-level BPE for free-form text such as
code), so vLLM, TorchTitan and transformers load it exactly as they would load Qwen3-1.7B.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ray_forge.config.schema import TinyModelConfig
from ray_forge.models.decoder import ARCHITECTURES

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<unk>", "<eos>")


class ModelError(ValueError):
    """A model folder is missing, incomplete or of an unsupported architecture."""


def check_model_dir(path: str | Path) -> Path:
    """Fail early, with the reason, on a folder that vLLM or TorchTitan could not load."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ModelError(f"model path {folder} does not exist (model.path must be a local HF folder)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"model path {folder} has no config.json: not a Hugging Face model folder")
    config = json.loads(config_file.read_text())
    if config.get("model_type") not in ARCHITECTURES:
        raise ModelError(f"model at {folder} is {config.get('model_type')!r}; ray_forge trains dense decoders "
                         f"of these types: {', '.join(ARCHITECTURES)}")
    if not any(folder.glob("*.safetensors")):
        raise ModelError(f"model path {folder} has no *.safetensors weights")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise ModelError(f"model path {folder} has no tokenizer files")
    return folder


def build_tokenizer(corpus: list[str], kind: str = "word", bpe_vocab_size: int = 1024, chat: bool = False,
                    split_digits: bool = False):
    """A tokenizer trained on ``corpus``, with the special tokens <pad> <unk> <eos> first.

    word: the vocabulary is exactly the words of ``corpus`` (decoding joins them with spaces).
    bpe: byte-level BPE (every byte is a token, so nothing is unknown and decoding is exact).
    chat: also the tokens of Qwen3's chat format, each whole (``ray_forge.core.chat.CHAT_TOKENS``),
    and a chat template in that format, for multi-turn episodes with tool calls.
    split_digits (bpe): each digit a token of its own.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ray_forge.core.chat import CHAT_TOKENS, TINY_TEMPLATE, TINY_TEMPLATE_TEXT

    specials = list(SPECIAL_TOKENS) + (list(CHAT_TOKENS) if chat else [])
    corpus = list(corpus) + ([TINY_TEMPLATE_TEXT] if chat else [])

    if kind == "word":
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(special_tokens=specials)
    elif kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if split_digits else byte_level)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=bpe_vocab_size, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r} (known: word, bpe)")
    tok.train_from_iterator(corpus, trainer)
    # No clean-up on decode: it would rewrite spaces before punctuation (" ," -> ",") in code.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>", bos_token=None,
        clean_up_tokenization_spaces=False, chat_template=TINY_TEMPLATE if chat else None,
    )


def make_tiny_qwen3(out_dir: str | Path, corpus: list[str], shape: TinyModelConfig, chat: bool = False) -> Path:
    """Write a random-init Qwen3 + tokenizer to ``out_dir`` (reused if already there); ``chat``:
    a tokenizer with Qwen3's chat format (see :func:`build_tokenizer`)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(out_dir)
    if (folder / "config.json").is_file():
        return check_model_dir(folder)
    tokenizer = build_tokenizer(corpus, shape.tokenizer, shape.bpe_vocab_size, chat, shape.split_digits)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(shape.seed)
    model = Qwen3ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    num_params = sum(p.numel() for p in model.parameters())
    log.info("made a tiny Qwen3 (%.2fM params, vocab %d) in %s", num_params / 1e6, len(tokenizer), folder)
    return folder
