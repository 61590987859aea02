"""How a state dict is laid out in byte buckets, and how it is packed and viewed again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

_ALIGN = 64  # every tensor starts on a 64-byte boundary, so a byte view can be reinterpreted as any dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int
    tensors: tuple[TensorSpec, ...]


def wire_dtype(tensor: torch.Tensor, dtype: str) -> torch.dtype:
    """Floating tensors travel as ``dtype`` when one is given; others (e.g. int buffers) as they are."""
    return getattr(torch, dtype) if dtype and tensor.is_floating_point() else tensor.dtype


def plan_buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int, dtype: str = "") -> list[Bucket]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes``; a larger tensor gets its own."""
    buckets: list[Bucket] = []
    specs: list[TensorSpec] = []
    used = 0

    def close() -> None:
        nonlocal specs, used
        if specs:
            buckets.append(Bucket(len(buckets), used, tuple(specs)))
        specs, used = [], 0

    for name, tensor in state_dict.items():
        out = wire_dtype(tensor, dtype)
        nbytes = tensor.numel() * out.itemsize
        start = -(-used // _ALIGN) * _ALIGN
        if specs and start + nbytes > bucket_bytes:
            close()
            start = 0
        specs.append(TensorSpec(name, str(out).removeprefix("torch."), tuple(tensor.shape), start, nbytes))
        used = start + nbytes
    close()
    return buckets


def pack_into(bucket: Bucket, state_dict: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy (and convert) the bucket's tensors into the uint8 buffer ``out``."""
    for spec, view in _views(bucket, out):
        view.copy_(state_dict[spec.name])


def unpack(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Zero-copy views of the bucket's tensors inside ``buffer`` (valid while ``buffer`` is)."""
    for spec, view in _views(bucket, buffer):
        yield spec.name, view


def _views(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    if buffer.dtype != torch.uint8 or buffer.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} needs a uint8 buffer of {bucket.nbytes} bytes, "
                         f"got {buffer.dtype} of {buffer.numel()}")
    for spec in bucket.tensors:
        raw = buffer[spec.offset:spec.offset + spec.nbytes]
        yield spec, raw.view(getattr(torch, spec.dtype)).view(spec.shape)
