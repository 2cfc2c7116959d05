"""Ulysses sequence parallelism over packed sequences.

Each of the `sp` ranks of a group runs the model on one chunk of a packed row. Everything but
attention works token by token; attention swaps the split with two all-to-alls: [heads, my chunk]
-> [my heads, the whole row], attention over the whole row with the pack's block-diagonal causal
mask, then back. Nothing is patched at import: `install_ulysses(model)` registers the attention
function under its own name and switches that model to it, and the sp process group travels with
each forward call as the `sp_group` keyword.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION_NAME = "infinite_rl_ulysses"


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous: empty_like keeps x's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, H, C, d] (all heads, my chunk) -> [b, H/sp, sp*C, d] (my heads, the whole row)."""
    sp = dist.get_world_size(group)
    b, h, c, d = x.shape
    x = x.reshape(b, sp, h // sp, c, d).permute(1, 0, 2, 3, 4)  # [sp, b, H/sp, C, d]: part j goes to rank j
    x = _all_to_all(x, group)  # part j now holds rank j's chunk of my heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * c, d)


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse: [b, H/sp, sp*C, d] -> [b, H, C, d]."""
    sp = dist.get_world_size(group)
    b, h, t, d = x.shape
    c = t // sp
    x = x.reshape(b, h, sp, c, d).permute(2, 0, 1, 3, 4)  # [sp, b, H/sp, C, d]: chunk j goes to rank j
    x = _all_to_all(x, group)  # part j now holds rank j's heads of my chunk
    return x.permute(1, 0, 2, 3, 4).reshape(b, sp * h, c, d)


class _SwapSplit(torch.autograd.Function):
    """One of the two all-to-alls forward (`to_seq`: heads -> sequence), the other backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, to_seq: bool) -> torch.Tensor:
        ctx.group, ctx.to_seq = group, to_seq
        return _heads_to_seq(x, group) if to_seq else _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return (_seq_to_heads(grad, ctx.group) if ctx.to_seq else _heads_to_seq(grad, ctx.group)), None, None


class _GatherChunks(torch.autograd.Function):
    """All-gather equal chunks along dim 0. Every rank then computes the same loss from the whole
    tensor, so each rank's chunk gets exactly its own slice of the gradient (no reduction)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's [C, ...] chunk -> the whole [sp*C, ...] row, differentiably (see _GatherChunks)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherChunks.apply(x, group)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *, sp_group: dist.ProcessGroup | None = None,
                      dropout: float = 0.0, scaling: float | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: query [b, H, C, d], key/value [b, Hkv, C, d] for this rank's
    chunk; `attention_mask` is the whole pack's [1, 1, T, T] boolean mask. Returns [b, C, H, d]."""
    if sp_group is None or dist.get_world_size(sp_group) == 1:
        out = _sdpa(query, key, value, attention_mask, scaling, dropout)
        return out.transpose(1, 2).contiguous(), None
    sp = dist.get_world_size(sp_group)
    if key.shape[1] % sp:  # too few key/value heads to split: give every query head its own copy
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = (_SwapSplit.apply(t, sp_group, True) for t in (query, key, value))
    out = _sdpa(q, k, v, attention_mask, scaling, dropout)
    out = _SwapSplit.apply(out, sp_group, False)
    return out.transpose(1, 2).contiguous(), None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
          dropout: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # grouped-query attention: query head h reads key/value head h // rep
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)


def install_ulysses(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers model) to Ulysses attention; forwards must then pass
    `sp_group=` and the pack's full mask. Registering under our own name changes no other model."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    model.set_attn_implementation(ATTENTION_NAME)
