"""Cutting a stream of (name, tensor) pairs into groups, so that work per tensor (a copy, a checksum)
runs as one batched call per group instead of one call per tensor, with bounded extra memory.

A group holds at most `max_bytes` of tensors, and keeps alive at most `max_bytes` of the buffers they
are views of (a view keeps its whole base buffer alive, a gathered bucket for instance), except that
its first tensor's buffer always fits: that one is alive anyway while the stream yields it.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def grouped(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) pairs in lists (module docstring), every pair exactly once, in order."""
    group: list[tuple[str, torch.Tensor]] = []
    size = held = 0
    bases: set[int] = set()
    for name, tensor in named:
        base = tensor._base if tensor._base is not None else tensor
        more = 0 if id(base) in bases else _nbytes(base)
        if group and (size + _nbytes(tensor) > max_bytes or (more and held + more > max_bytes)):
            yield group
            group, size, held, bases = [], 0, 0, set()
            more = _nbytes(base)
        group.append((name, tensor))
        bases.add(id(base))
        size += _nbytes(tensor)
        held += more
    if group:
        yield group
