"""An exact checksum of a tensor's values, equal wherever the same values are held (any device, any
summation order): what the trainer sent and what the rollout engine holds are compared with it.

The tensor's bytes are read as 32-bit words (as wide as an element or wider: bf16 pairs, halves of
fp64) and each row's words are summed with int32 wrap-around, which is exact modular arithmetic in
any order and as fast as a float sum (an int64 accumulation costs ~30x more on CPU). The row sums are
then mixed with their row index (so swapped rows differ) into one int64. Tensors whose rows are not
whole words (odd-length bf16 rows, bool or int8 buffers) sum each element's bits as int64 instead.
"""
from __future__ import annotations

import torch

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 1_000_003  # combines the two sums into one int64 (wrapping is fine: both sides wrap alike)


def row_words(tensor: torch.Tensor) -> torch.Tensor:
    """[rows, words per row] int32 view of a contiguous tensor's bytes (dim 0 = rows; a 0-d or 1-d
    tensor is one row), or [rows, elements] of its bits as integers when a row is not whole words."""
    t = tensor.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    rows = t.shape[0] if t.dim() > 1 else 1
    row_bytes = t.numel() * t.element_size() // max(rows, 1)
    if t.numel() and row_bytes % 4 == 0:
        return t.reshape(rows, -1).view(torch.int32)
    bits = t.view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t
    return bits.reshape(rows, -1)


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 tensor on `tensor`'s device (no host sync here); see the module docstring."""
    words = row_words(tensor)
    accumulate = torch.int32 if words.dtype == torch.int32 else torch.int64
    rows = words.sum(dim=1, dtype=accumulate).to(torch.int64)
    # sum(rows) * _MIX + sum((i + 1) * rows[i]) in one product
    weights = torch.arange(_MIX + 1, _MIX + 1 + rows.numel(), dtype=torch.int64, device=rows.device)
    return (rows * weights).sum()
