"""Grouping full weight tensors into dtype-homogeneous buckets of bounded size for a weight push.

A push sends one flat buffer per bucket instead of one message per parameter (a 7B model has ~300
tensors), and a bucket size cap bounds the extra memory a push needs. Tensors arrive as a stream
(each one just all-gathered with `full_tensor()`), so buckets are filled on the fly: one open
bucket per dtype; a bucket is emitted when the next tensor of its dtype would overflow it.

Guarantees (tested): every tensor appears in exactly one bucket, in arrival order within its dtype;
every bucket holds a single dtype; a bucket's byte size is at most the cap, except a bucket with a
single tensor that is by itself larger than the cap (a tensor is never split).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

MB = 1 << 20


@dataclass
class Bucket:
    dtype: torch.dtype
    named_tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.named_tensors.append((name, tensor))
        self.nbytes += tensor_nbytes(tensor)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.named_tensors]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], cap_bytes: int) -> Iterator[Bucket]:
    """Yield buckets as soon as they are full; the remaining partial buckets come last, in the
    order their dtype was first seen. Holds at most one open bucket per dtype."""
    if cap_bytes < 1:
        raise ValueError(f"bucket cap must be >= 1 byte, got {cap_bytes}")
    open_buckets: dict[torch.dtype, Bucket] = {}
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"weight push: tensor {name!r} appears twice")
        seen.add(name)
        size = tensor_nbytes(tensor)
        bucket = open_buckets.get(tensor.dtype)
        if bucket is not None and bucket.named_tensors and bucket.nbytes + size > cap_bytes:
            yield bucket
            bucket = None
        if bucket is None:
            bucket = open_buckets[tensor.dtype] = Bucket(tensor.dtype)
        bucket.add(name, tensor)
        if bucket.nbytes >= cap_bytes:  # full (or one oversized tensor): send it now, free it sooner
            yield open_buckets.pop(tensor.dtype)
    for bucket in open_buckets.values():
        if bucket.named_tensors:
            yield bucket

