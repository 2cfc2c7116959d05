"""Reward shaping from response lengths."""
from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(response_lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment: 0 if L <= Lmax - buffer, -penalty*(L - (Lmax - buffer))/buffer up to Lmax, -penalty beyond.

    At L = Lmax the penalty is the full -penalty; with buffer = 0 only L > Lmax is penalised.
    Integer lengths give a tensor of the default float dtype.
    """
    if not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer must be in [0, max_new_tokens={max_new_tokens}], got {buffer}")
    L = response_lengths
    if not L.is_floating_point():
        L = L.to(torch.get_default_dtype())
    start = max_new_tokens - buffer
    if buffer == 0:
        frac = (L > max_new_tokens).to(L.dtype)
    else:
        frac = ((L - start) / buffer).clamp(0.0, 1.0)
    return 0.0 - penalty * frac  # (not -penalty * frac: no -0.0)
