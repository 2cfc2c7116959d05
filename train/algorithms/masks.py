"""Masked reductions and sequence <-> token placement over [B, T] tensors with an action mask."""
from __future__ import annotations

import torch
from torch import Tensor


def float_mask(mask: Tensor, like: Tensor) -> Tensor:
    """The mask as a 0/1 float tensor of `like`'s dtype and device."""
    return mask.to(dtype=like.dtype, device=like.device)


def bool_mask(mask: Tensor) -> Tensor:
    """The mask as a bool tensor."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) over `dim` (all dims if None); masked-out entries never leak NaN/inf."""
    v = torch.where(bool_mask(mask), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return v.sum() if dim is None else v.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / max(1, sum(mask)) over `dim` (all dims if None)."""
    n = float_mask(mask, values).sum() if dim is None else float_mask(mask, values).sum(dim)
    return masked_sum(values, mask, dim) / n.clamp_min(1.0)


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """out[b, t] = seq_values[b] * mask[b, t]: the sequence value on every action token, 0 elsewhere."""
    zero = torch.zeros((), dtype=seq_values.dtype, device=seq_values.device)
    return torch.where(bool_mask(mask), seq_values[:, None], zero)


def last_action_token_index(mask: Tensor) -> Tensor:
    """idx[b] = max{t : mask[b, t] = 1}; -1 for a row without action tokens."""
    m = bool_mask(mask)
    T = m.shape[1]
    pos = torch.arange(T, device=m.device).expand_as(m)
    return torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=1)


def place_on_last_action_token(seq_values: Tensor, mask: Tensor) -> Tensor:
    """out[b, idx[b]] = seq_values[b] at the last action token, 0 elsewhere (rows without actions: all 0)."""
    idx = last_action_token_index(mask)
    B, T = mask.shape
    onehot = torch.arange(T, device=mask.device)[None, :] == idx[:, None]  # idx == -1 matches nothing
    zero = torch.zeros((), dtype=seq_values.dtype, device=seq_values.device)
    return torch.where(onehot, seq_values[:, None], zero)
