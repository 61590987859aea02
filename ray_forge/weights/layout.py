"""How a version is laid out in byte buckets, packed by senders, and put back together by receivers.

A sender puts *pieces*: a whole tensor, or the rows it holds of a larger one (an FSDP2 rank's
Shard(0) slice). Buckets are planned per *group* of whole tensors, identically on every sender:
group ``g`` holds the same tensor names on every rank, and rank ``r``'s bucket ``g`` holds its
rows of them. A receiver reads group by group (every rank's bucket ``g``, then ``g + 1``), so it
assembles one group of whole tensors at a time and never holds more than about one bucket of them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import torch

_ALIGN = 64  # every tensor starts on a 64-byte boundary, so a byte view can be reinterpreted as any dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    """Of the bytes in this bucket: the whole tensor, or this piece's rows."""
    offset: int
    nbytes: int
    full_shape: tuple[int, ...] | None = None
    """Set when the bytes are rows of a larger tensor: that tensor's shape (None: the whole tensor)."""
    row_offset: int = 0
    """The first row of the whole tensor that this piece holds."""

    @property
    def key(self) -> str:
        """Names the piece among a sender's tensors (a rank may hold several row ranges of one tensor)."""
        return self.name if self.full_shape is None else f"{self.name}@{self.row_offset}"


@dataclass(frozen=True)
class Bucket:
    index: int
    """The group this bucket belongs to: the same index on every sender holds the same tensor names."""
    nbytes: int
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class Piece:
    """What a sender contributes to one tensor: all of it, some of its rows, or nothing (``tensor`` None).

    Every sender lists every tensor, even those it holds no rows of, so that all of them plan the
    same groups without talking to each other."""

    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    row_offset: int = 0
    tensor: torch.Tensor | None = None

    @property
    def whole(self) -> bool:
        return self.tensor is not None and self.row_offset == 0 and tuple(self.tensor.shape) == self.full_shape

    @property
    def key(self) -> str:
        return self.name if self.whole else f"{self.name}@{self.row_offset}"


def whole_pieces(state_dict: Mapping[str, torch.Tensor]) -> list[Piece]:
    return [Piece(name, tuple(t.shape), t.dtype, 0, t) for name, t in state_dict.items()]


def wire_dtype(tensor_or_dtype: torch.Tensor | torch.dtype, dtype: str) -> torch.dtype:
    """Floating tensors travel as ``dtype`` when one is given; others (e.g. int buffers) as they are."""
    source = tensor_or_dtype if isinstance(tensor_or_dtype, torch.dtype) else tensor_or_dtype.dtype
    return getattr(torch, dtype) if dtype and source.is_floating_point else source


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def plan_groups(pieces: list[Piece], bucket_bytes: int, dtype: str = "") -> dict[str, int]:
    """Tensor name -> group index: whole tensors in order, packed into groups of at most
    ``bucket_bytes`` (a larger tensor gets its own). Depends only on names, shapes and dtypes,
    which every sender knows, so every sender computes the same groups."""
    groups: dict[str, int] = {}
    index, used, in_group = 0, 0, 0
    for piece in pieces:
        if piece.name in groups:
            continue
        nbytes = _numel(piece.full_shape) * wire_dtype(piece.dtype, dtype).itemsize
        start = _aligned(used)
        if in_group and start + nbytes > bucket_bytes:
            index, start, in_group = index + 1, 0, 0
        groups[piece.name] = index
        used, in_group = start + nbytes, in_group + 1
    return groups


def plan_pieces(pieces: list[Piece], bucket_bytes: int, dtype: str = "") -> list[Bucket]:
    """This sender's buckets: for each group, the pieces it holds of that group's tensors. A group
    it holds nothing of has no bucket here (indices may skip)."""
    groups = plan_groups(pieces, bucket_bytes, dtype)
    by_group: dict[int, list[TensorSpec]] = {}
    used: dict[int, int] = {}
    for piece in pieces:
        if piece.tensor is None:
            continue
        g = groups[piece.name]
        out = wire_dtype(piece.tensor, dtype)
        nbytes = piece.tensor.numel() * out.itemsize
        start = _aligned(used.get(g, 0)) if g in by_group else 0
        whole = piece.whole
        by_group.setdefault(g, []).append(TensorSpec(
            piece.name, str(out).removeprefix("torch."), tuple(piece.tensor.shape), start, nbytes,
            full_shape=None if whole else piece.full_shape, row_offset=0 if whole else piece.row_offset))
        used[g] = start + nbytes
    return [Bucket(g, used[g], tuple(specs)) for g, specs in sorted(by_group.items())]


def plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int, dtype: str = "") -> list[Bucket]:
    """Buckets of whole tensors (one sender holding the whole state dict)."""
    return plan_pieces(whole_pieces(state_dict), bucket_bytes, dtype)


def pack_into(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy (and convert) the bucket's pieces, looked up by :attr:`TensorSpec.key`, into the uint8 buffer ``out``."""
    for spec, view in views(bucket, out):
        view.copy_(tensors[spec.key])


def unpack(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Zero-copy views of the bucket's whole tensors inside ``buffer`` (valid while ``buffer`` is)."""
    for spec, view in views(bucket, buffer):
        if spec.full_shape is not None:
            raise ValueError(f"bucket {bucket.index} holds rows of {spec.name}, not the whole tensor: use assemble()")
        yield spec.name, view


def views(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    if buffer.dtype != torch.uint8 or buffer.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} needs a uint8 buffer of {bucket.nbytes} bytes, "
                         f"got {buffer.dtype} of {buffer.numel()}")
    for spec in bucket.tensors:
        raw = buffer[spec.offset:spec.offset + spec.nbytes]
        yield spec, raw.view(getattr(torch, spec.dtype)).view(spec.shape)


class _Partial:
    """A whole tensor being filled from pieces; knows which rows arrived."""

    def __init__(self, spec: TensorSpec, device: torch.device) -> None:
        self.tensor = torch.empty(spec.full_shape, dtype=getattr(torch, spec.dtype), device=device)
        self.rows: list[tuple[int, int]] = []

    def add(self, spec: TensorSpec, view: torch.Tensor, what: str) -> bool:
        """Copy the piece in; True once every row has arrived exactly once."""
        start, end = spec.row_offset, spec.row_offset + spec.shape[0]
        if tuple(spec.full_shape[1:]) != tuple(spec.shape[1:]) or end > spec.full_shape[0]:
            raise ValueError(f"{what}: a piece of {spec.name} with shape {spec.shape} at row {start} does not fit "
                             f"its whole shape {spec.full_shape}")
        self.tensor[start:end].copy_(view)
        self.rows.append((start, end))
        if sum(e - s for s, e in self.rows) < spec.full_shape[0]:
            return False
        covered = 0
        for s, e in sorted(self.rows):
            if s != covered:
                raise ValueError(f"{what}: the pieces of {spec.name} overlap or leave a gap at row {covered} "
                                 f"(rows received: {sorted(self.rows)})")
            covered = e
        return True


def assemble(stream: Iterable[tuple[Bucket, torch.Tensor]], what: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors from buckets read in group order (every sender's bucket ``g``, then ``g + 1``).

    A whole tensor in a bucket is yielded as a view (valid until the next bucket is read); one
    sent in pieces is copied into a fresh tensor and yielded once its last rows arrive. When a
    group ends, every tensor it started must be complete: a missing piece is an error naming the
    tensor, never a silently partial weight."""
    pending: dict[str, _Partial] = {}
    group = None
    for bucket, buffer in stream:
        if bucket.index != group:
            _check_complete(pending, what)
            group = bucket.index
        for spec, view in views(bucket, buffer):
            if spec.full_shape is None:
                yield spec.name, view
                continue
            partial = pending.get(spec.name) or pending.setdefault(spec.name, _Partial(spec, view.device))
            if partial.add(spec, view, what):
                yield spec.name, pending.pop(spec.name).tensor
    _check_complete(pending, what)


def _check_complete(pending: dict[str, _Partial], what: str) -> None:
    if pending:
        name, partial = next(iter(pending.items()))
        raise ValueError(f"{what}: {len(pending)} tensors are missing rows, e.g. {name} "
                         f"(rows received: {sorted(partial.rows)} of {partial.tensor.shape[0]})")


def tensors_digest(named_tensors) -> str:
    """A hash of names, dtypes, shapes and bytes, independent of order: equal digests mean
    bitwise-equal state dicts."""
    entries = []
    for name, tensor in named_tensors:
        t = tensor.detach().contiguous().cpu()
        h = hashlib.blake2b(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode(), digest_size=16)
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        entries.append(h.hexdigest())
    return hashlib.blake2b("".join(sorted(entries)).encode(), digest_size=16).hexdigest()
