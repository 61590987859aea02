"""TorchTitan's dense decoders built from a local Hugging Face folder, sharded with FSDP2, exported in HF naming.

Two architectures, told apart by ``config.json``'s ``model_type``: ``qwen3`` (TorchTitan's Qwen3,
with its q/k norms) and ``llama`` (TorchTitan's Llama 3 model, e.g. SmolLM2). Both use HF's
rotate-half RoPE (``CosSinRoPE``), so their weights load under their HF names unchanged: the
state-dict adapter only renames, which the sharded load and the shard-by-shard weight export rely
on. (TorchTitan's own Llama adapter permutes q and k for its complex RoPE; that layout is never used.)
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor

from ray_forge.models import devices

_LINEAR_INIT = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBED_INIT = {"weight": partial(nn.init.normal_, std=0.02)}
ARCHITECTURES = ("qwen3", "llama")
"""The ``model_type`` values of the HF folders ray_forge trains."""


def _architecture(model_type: str):
    """(model class, block class, parallelize function, has q/k norms) of a ``model_type``."""
    if model_type == "qwen3":
        from torchtitan.models.qwen3 import Qwen3Model, Qwen3TransformerBlock, parallelize_qwen3

        return Qwen3Model, Qwen3TransformerBlock, parallelize_qwen3, True
    if model_type == "llama":
        from torchtitan.models.llama3 import Llama3Model, parallelize_llama
        from torchtitan.models.llama3.model import Llama3TransformerBlock

        return Llama3Model, Llama3TransformerBlock, parallelize_llama, False
    raise ValueError(f"model_type {model_type!r} is not one of {ARCHITECTURES}")


def decoder_config(hf_dir: str | Path, device_type: str = "cpu"):
    """TorchTitan ``Qwen3Model.Config`` or ``Llama3Model.Config`` with the shape of the HF ``config.json``."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.nn_modules import RMSNorm

    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    model_cls, block_cls, _, qk_norm = _architecture(hf.get("model_type"))
    dim, num_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // num_heads
    eps = hf.get("rms_norm_eps", 1e-6)
    rope_params = hf.get("rope_parameters") or {}
    if rope_params.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ValueError(f"{hf_dir}: only default RoPE is supported, got {rope_params or hf.get('rope_scaling')}")
    if hf.get("attention_bias") or hf.get("mlp_bias") or hf.get("use_sliding_window"):
        raise ValueError(f"{hf_dir}: biases and sliding windows are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{hf_dir}: only SwiGLU feed-forwards (hidden_act silu) are supported, got {hf['hidden_act']}")
    theta = rope_params.get("rope_theta", hf.get("rope_theta", 10000.0))

    def norm(size: int):
        return RMSNorm.Config(normalized_shape=size, eps=eps, param_init=_NORM_INIT)

    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=theta)
    block = block_cls.Config(
        attention_norm=norm(dim),
        ffn_norm=norm(dim),
        attention=make_gqa_config(
            dim=dim, n_heads=num_heads, n_kv_heads=hf["num_key_value_heads"], head_dim=head_dim,
            wqkv_param_init=_LINEAR_INIT, wo_param_init=_LINEAR_INIT,
            inner_attention=devices.inner_attention_config(device_type),
            fuse_qkv=True, rope=rope, qk_norm=norm(head_dim) if qk_norm else None,
        ),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=hf["intermediate_size"],
                                     w1_param_init=_LINEAR_INIT, w2w3_param_init=_LINEAR_INIT),
    )
    vocab = hf["vocab_size"]
    return model_cls.Config(
        vocab_size=vocab, dim=dim, norm=norm(dim),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBED_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=[block for _ in range(hf["num_hidden_layers"])],
    )


def _adapter(config):
    """The plain-rename state-dict adapter (Qwen3's serves both: HF Llama names are Qwen3's without q/k norms)."""
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(config, None)


def build_decoder(hf_dir: str | Path, device_type: str = "cpu"):
    """(model, state_dict_adapter) with the folder's weights loaded, unsharded, in float32.

    The whole model in every process that calls it: the reference model and checks use it;
    trainer ranks use :func:`build_sharded_decoder`."""
    config = decoder_config(hf_dir, device_type)
    model = config.build()
    adapter = _adapter(config)
    hf_state = {}
    for shard in sorted(Path(hf_dir).glob("*.safetensors")):
        hf_state.update(load_file(shard))
    model.load_state_dict(adapter.from_hf({k: v.float() for k, v in hf_state.items()}), strict=True)
    return model.to(device_type), adapter


def build_sharded_decoder(hf_dir: str | Path, world_size: int, device_type: str = "cpu",
                          param_dtype: str = "float32"):
    """(model, adapter): built on the meta device, sharded with FSDP2, then each rank loads only
    its own rows of each weight, one tensor at a time. No rank holds the whole model: beyond the
    shard it holds one full tensor, and briefly the attention projections that TorchTitan's
    fused-QKV state-dict hooks gather."""
    config = decoder_config(hf_dir, device_type)
    with torch.device("meta"):
        model = config.build()
    adapter = _adapter(config)
    model_type = json.loads((Path(hf_dir) / "config.json").read_text())["model_type"]
    model = shard_fsdp2(model, world_size, device_type, param_dtype, model_type)
    model.to_empty(device=device_type)
    with torch.no_grad():
        # Computes the buffers (RoPE tables) and re-ties a tied head; the weights are overwritten next.
        model.init_states(buffer_device=torch.device(device_type))
    load_hf_shards(model, adapter, hf_dir)
    return model, adapter


def load_hf_shards(model: nn.Module, adapter, hf_dir: str | Path) -> None:
    """Fill a sharded model from the folder's safetensors: each rank reads a tensor, keeps its
    rows (no communication) and drops the rest before reading the next."""
    from safetensors import safe_open
    from torch.distributed.tensor import distribute_tensor

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update({key: (file, f.get_slice(key).get_shape()) for key in f.keys()})
    source = titan_sources(adapter, {key: shape for key, (_, shape) in where.items()})
    state = model.state_dict()
    if missing := set(state) - set(source):
        raise ValueError(f"{hf_dir} has no weights for {sorted(missing)[:5]}")
    loaded = {}
    for key, target in state.items():
        file, _ = where[source[key]]
        with safe_open(str(file), framework="pt") as f:
            full = f.get_tensor(source[key]).to(torch.float32)
        if isinstance(target, DTensor):
            loaded[key] = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        else:
            loaded[key] = full.to(target.device)
        del full
    # load_state_dict, not copy_: TorchTitan fuses wq/wk/wv into one parameter in its load hook.
    model.load_state_dict(loaded, strict=True)


def titan_sources(adapter, hf_shapes: dict[str, list[int]]) -> dict[str, str]:
    """TorchTitan key -> the HF key it is read from, found by running the adapter on meta tensors:
    a dense decoder's adapter only renames, and a tied head reads the embedding."""
    hf = {key: torch.empty(shape, device="meta") for key, shape in hf_shapes.items()}
    by_id = {id(t): key for key, t in hf.items()}
    titan = adapter.from_hf(dict(hf))
    if transformed := [key for key, t in titan.items() if id(t) not in by_id]:
        raise ValueError(f"the adapter transforms {transformed[:3]} (not a plain rename): a dense decoder was expected")
    return {key: by_id[id(t)] for key, t in titan.items()}


def shard_fsdp2(model: nn.Module, world_size: int, device_type: str, param_dtype: str = "float32",
                model_type: str = "qwen3") -> nn.Module:
    """FSDP2 over all ranks through TorchTitan's ``parallelize_qwen3`` (``parallelize_llama``). Master weights, gradients
    and their reduction stay float32; ``param_dtype`` is what forward and backward compute in
    (bfloat16: FSDP2 casts each gathered layer, as on GPU)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    _, _, parallelize, _ = _architecture(model_type)
    devices.prepare_distributed(device_type)
    parallelism = ParallelismConfig(data_parallel_shard_degree=world_size, spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(parallelism, world_size)
    model = parallelize(
        model, parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=param_dtype, mixed_precision_reduce="float32"),
        parallelism=parallelism, compile_config=CompileConfig(enable=False), ac_config=None,
        dump_folder="/tmp/ray_forge_titan",
    )
    devices.use_sum_reductions(model, device_type)
    return model


def full_hf_state_dict(model: nn.Module, adapter) -> dict[str, torch.Tensor]:
    """Gather shards (a collective: every rank calls it) and rename to HF keys for vLLM."""
    # DCP's get_model_state_dict fails on TorchTitan's fused QKV, so gather DTensors directly.
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return {k: v.detach().contiguous().cpu() for k, v in adapter.to_hf(state).items()}
