"""A trainer rank's own rows of every weight, in Hugging Face naming, without communication.

FSDP2 shards every parameter with ``Shard(0)`` over the data-parallel mesh: torch.chunk
semantics, so rank ``r`` holds rows ``[r * ceil(n / world), ...)``, fewer on the last ranks and
none at all on high ranks of a short tensor. ``model.state_dict()`` cannot be used to find them:
TorchTitan fuses q/k/v into one ``wqkv`` parameter and its state-dict hook all-gathers it
(``redistribute`` to ``Replicate``) before splitting it into ``wq``/``wk``/``wv``, so every rank
would receive the whole of every attention projection. Instead each rank reads its local rows
from the parameters, splits its rows of ``wqkv`` into the q/k/v rows they are, and renames the
TorchTitan keys with the state-dict adapter (run on meta tensors: a dense decoder's adapter only
renames, and drops ``lm_head.weight`` when the embeddings are tied).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ray_forge.weights.layout import Piece


def chunk_rows(num_rows: int, world_size: int, index: int) -> tuple[int, int]:
    """(first row, row count) of chunk ``index`` when ``torch.chunk`` splits ``num_rows`` rows
    into ``world_size`` chunks, as FSDP2's Shard(0) does; high chunks may be empty."""
    size = -(-num_rows // world_size)
    start = min(index * size, num_rows)
    return start, min(size, num_rows - start)


def local_hf_pieces(model: nn.Module, adapter) -> list[Piece]:
    """This rank's pieces of every HF tensor (every tensor listed, ``tensor=None`` where this rank
    holds no rows), each a view of the local shard, with its whole shape and first row."""
    by_titan_key = dict(_titan_pieces(model))
    if moe := [k for k in by_titan_key if ".moe." in k]:
        raise NotImplementedError(f"sharded weight export handles dense models only; {moe[0]} is a MoE expert weight")
    meta = {key: torch.empty(pieces[0].full_shape, device="meta") for key, pieces in by_titan_key.items()}
    titan_by_id = {id(t): key for key, t in meta.items()}
    renamed = adapter.to_hf(dict(meta))
    if transformed := [k for k, t in renamed.items() if id(t) not in titan_by_id]:
        raise ValueError(f"the state-dict adapter transforms {transformed[:3]} (not a plain rename): "
                         "a dense decoder was expected")
    return [Piece(hf_key, p.full_shape, p.dtype, p.row_offset, p.tensor)
            for hf_key, t in renamed.items() for p in by_titan_key[titan_by_id[id(t)]]]


def _titan_pieces(model: nn.Module) -> Iterator[tuple[str, list[Piece]]]:
    """(TorchTitan state-dict key, this rank's pieces of it), in state-dict order."""
    fused = {f"{prefix}.wqkv.": module for prefix, module in model.named_modules() if _is_fused_qkv(module)}
    for name, tensor in _state_tensors(model):
        local, row_offset, full_shape = local_rows(name, tensor)
        prefix = next((p for p in fused if name.startswith(p)), None)
        if prefix is None:
            yield name, [Piece(name, full_shape, tensor.dtype, row_offset, local)]
            continue
        module, leaf = fused[prefix], name[len(prefix):]
        split = split_fused_qkv(local, row_offset, full_shape, module.heads_per_kv, module.head_dim)
        for target, (target_shape, pieces) in split.items():
            key = f"{prefix[:-len('wqkv.')]}{target}.{leaf}"
            yield key, [Piece(key, target_shape, tensor.dtype, offset, rows) for offset, rows in pieces] or [
                Piece(key, target_shape, tensor.dtype)]


def _is_fused_qkv(module: nn.Module) -> bool:
    from torchtitan.models.common.attention import FusedQKVLinear

    return isinstance(module, FusedQKVLinear)


def _state_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones under every name, as the state dict lists them) and persistent buffers."""
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=False):
            yield name, param.detach()
        for prefix, module in model.named_modules():
            for leaf, buffer in module.named_buffers(recurse=False):
                if buffer is not None and leaf not in module._non_persistent_buffers_set:
                    yield f"{prefix}.{leaf}" if prefix else leaf, buffer


def local_rows(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor | None, int, tuple[int, ...]]:
    """(this rank's rows or None, their first row, the whole shape) of one state-dict tensor."""
    full_shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        # Every rank holds all of it (not sharded): rank 0 sends it.
        owner = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        return (tensor if owner else None), 0, full_shape
    mesh, (placement, *more) = tensor.device_mesh, tensor.placements
    if more or mesh.ndim != 1:
        raise NotImplementedError(f"{name}: sharded weight export handles a 1-D FSDP mesh, got placements "
                                  f"{tensor.placements} on a {mesh.ndim}-D mesh")
    local, index = tensor.to_local(), mesh.get_local_rank()
    if isinstance(placement, Replicate):
        return (local if index == 0 else None), 0, full_shape
    if not (isinstance(placement, Shard) and placement.dim == 0):
        raise NotImplementedError(f"{name}: sharded weight export handles Shard(0) and Replicate, got {placement}")
    start, count = chunk_rows(full_shape[0], mesh.size(), index)
    if local.shape[0] != count:
        raise ValueError(f"{name}: rank {index} of {mesh.size()} holds {local.shape[0]} rows of {full_shape}, "
                         f"torch.chunk would give it {count}")
    return (local if count else None), start, full_shape


def split_fused_qkv(local: torch.Tensor | None, row_offset: int, full_shape: tuple[int, ...], heads_per_kv: int,
                    head_dim: int) -> dict[str, tuple[tuple[int, ...], list[tuple[int, torch.Tensor]]]]:
    """Rows ``[row_offset, row_offset + len(local))`` of a fused ``wqkv`` weight (or bias), as
    pieces of ``wq``/``wk``/``wv``: {target: (its whole shape, [(first row, rows), ...])}.

    The fused rows are ``n_kv`` groups of ``heads_per_kv + 2`` heads of ``head_dim`` rows: the
    group's q heads, then its k head, then its v head (TorchTitan's ``FusedQKVLinear``). A rank's
    contiguous rows cross several groups, so it may hold several row ranges of each target."""
    per_group = (heads_per_kv + 2) * head_dim
    num_kv, tail = full_shape[0] // per_group, tuple(full_shape[1:])
    shapes = {"wq": (num_kv * heads_per_kv * head_dim, *tail), "wk": (num_kv * head_dim, *tail),
              "wv": (num_kv * head_dim, *tail)}
    out: dict[str, tuple[tuple[int, ...], list[tuple[int, torch.Tensor]]]] = {k: (s, []) for k, s in shapes.items()}
    if local is None:
        return out
    lo, hi = row_offset, row_offset + local.shape[0]
    q_rows = heads_per_kv * head_dim
    for group in range(num_kv):
        base = group * per_group
        segments = (("wq", base, base + q_rows, group * q_rows),
                    ("wk", base + q_rows, base + q_rows + head_dim, group * head_dim),
                    ("wv", base + q_rows + head_dim, base + per_group, group * head_dim))
        for target, start, end, target_start in segments:
            a, b = max(start, lo), min(end, hi)
            if a < b:
                out[target][1].append((target_start + a - start, local[a - lo:b - lo]))
    return out
