"""A trainer's weights as a self-contained Hugging Face folder (the GRPO job's policies, the SFT job's model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SAVED_STEP = "ray_forge.json"
"""In an exported folder: which step's weights it holds."""


async def save_hf_folder(trainer, model_dir: str, out_dir: Path, step: int, dtype: str) -> None:
    """The current weights of ``trainer`` (a ``TrainerGroup``) with the config and tokenizer of
    the base model in ``model_dir``, made whole under another name, then renamed into place. The
    weights are in the training ``dtype``, and config.json says so (engines loading it with dtype
    auto use that)."""
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    await trainer.export_hf(str(partial))
    for item in Path(model_dir).iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy2(item, partial / item.name)
    hf_config = json.loads((partial / "config.json").read_text())
    hf_config.update({k: dtype for k in ("torch_dtype", "dtype") if k in hf_config} or {"torch_dtype": dtype})
    (partial / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (partial / SAVED_STEP).write_text(json.dumps({"step": step}))
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
