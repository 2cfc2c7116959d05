"""Attention over packed rows, segment by segment, with Ulysses sequence parallelism or ring attention
(context parallelism) on top.

`packed_attention` is a transformers attention function. A packed row holds several sequences
(segments); attention gathers each segment's queries, keys and values into a [segments, longest]
batch, runs causal SDPA on it and scatters the result back, so no sequence sees another and the
cost is that of the segments, not of the whole row squared (a varlen attention, in plain torch).

With `sp_group` (Ulysses), each of the `sp` ranks of a group runs the model on one chunk of the
row. Everything but attention works token by token; attention swaps the split with two
all-to-alls: [heads, my chunk] -> [my heads, the whole row], segment attention, then back.

With a `RingRow` as the row's segments (context parallelism, `cp_size`), each of the `cp` ring ranks holds
two of the row's 2·cp chunks, zigzag (chunks r and 2·cp−1−r, so every rank has as much causal work), cut in
sp pieces when Ulysses runs inside (the all-to-alls give each sp rank the ring rank's whole chunk for its
heads); key/value blocks go round the ring (train/parallel/ring_attention.py).

Nothing is patched at import: `install_packed_attention(model)` registers the function under its
own name and switches that model to it; the segments (`packed_segments`) and the sp process group
(`sp_group`) travel with each forward call as keywords.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from train.parallel.ring_attention import RingRow, ring_attention, zigzag_rows

ATTENTION_NAME = "infinite_rl_packed"


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


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, ring: int = 0) -> torch.Tensor:
    """This rank's [C, ...] chunk -> the whole [n*C, ...] row, differentiably (see _GatherChunks). With a
    `ring` the ranks' chunks are zigzag pieces (sequence_rows), put back in row order."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    whole = _GatherChunks.apply(x, group)
    if not ring:
        return whole
    n = dist.get_world_size(group)
    order = torch.cat([sequence_rows(r, n, ring, n * x.shape[0]) for r in range(n)]).argsort().to(x.device)
    return whole.index_select(0, order)


def sequence_rows(rank: int, n: int, ring: int, total: int) -> torch.Tensor:
    """The positions of a row of `total` that rank `rank` of the `n` ranks it is split over holds: with a
    `ring` of cp ranks (n = cp x sp, ring-major), ring rank c's two zigzag half chunks (zigzag_rows), cut in
    sp contiguous pieces, one per Ulysses rank; without, the rank's contiguous chunk."""
    if not ring:
        chunk = total // n
        return torch.arange(rank * chunk, (rank + 1) * chunk)
    sp = n // ring
    ring_rank, sp_rank = divmod(rank, sp)
    rows = zigzag_rows(ring_rank, ring, total // (2 * ring))
    piece = rows.numel() // sp
    return rows[sp_rank * piece:(sp_rank + 1) * piece]


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *,
                     packed_segments: tuple[torch.Tensor, torch.Tensor] | None = None,
                     sp_group: dist.ProcessGroup | None = None, cp_group: dist.ProcessGroup | None = None,
                     dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """query [1, H, C, d], key/value [1, Hkv, C, d] for this rank's chunk of a packed row;
    `packed_segments` = (slots, real): the whole row's segment slots, built once per micro-batch
    by `segment_slots` (train/parallel/packing.py). `sliding_window` (Mistral, Gemma's local layers): a
    query sees the keys less than that many positions back, as transformers' own masks. `s_aux` (GPT-OSS's
    attention sinks, one logit per head): a column in every query's softmax that takes probability and
    adds no value. Returns [1, C, H, d]."""
    if packed_segments is None:
        raise ValueError("packed attention needs packed_segments= (train/parallel/packing.py PackedMicroBatch.model_inputs)")
    if softcap is not None:
        raise ValueError(f"packed attention does not cap attention logits (softcap={softcap}, Gemma 2's "
                         "attn_logit_softcapping): this model would train on other numbers than it samples with")
    sp = dist.get_world_size(sp_group) if sp_group is not None else 1
    ring = isinstance(packed_segments, RingRow)
    if ring and (s_aux is not None or dropout):
        raise ValueError("ring attention (cp_size > 1) runs without attention sinks (GPT-OSS) and dropout")
    if sp > 1:
        if key.shape[1] % sp:  # too few key/value heads to split: give every query head its own copy
            rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        query, key, value = (_SwapSplit.apply(t, sp_group, True) for t in (query, key, value))
        if s_aux is not None:  # this rank's heads (_SwapSplit gives rank r the r-th block of heads)
            s_aux = s_aux.view(sp, -1)[dist.get_rank(sp_group)]
    if ring:  # after Ulysses' all-to-alls this rank holds its ring rank's whole chunk, for its heads
        out = ring_attention(query, key, value, packed_segments, cp_group, scaling, sliding_window)
    else:
        out = _segment_attention(query, key, value, packed_segments, scaling, dropout, sliding_window, s_aux)
    if sp > 1:
        out = _SwapSplit.apply(out, sp_group, False)
    return out.transpose(1, 2).contiguous(), None


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: tuple,
                       scaling: float | None, dropout: float, window: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[1, H, T, d] -> [1, H, T, d], causal within each segment: each segment's slots are gathered
    into a [segments, H, longest, d] batch, left-aligned (a real query never sees a slot past its
    segment's end), and the real slots are taken back in row order. index_select both ways: its
    backward is an index_add, not a scatter with accumulation.

    `segments` = (slots, real) or, with shared prompts (train/parallel/packing.py `shared_slots`),
    (slots, real, suffix_queries, suffix_keys, prefix_lengths): each sample's own tokens then query
    only, over its prompt's keys followed by its own (query i sees the prompt and own keys up to i),
    so a prompt's attention is computed once, in its own segment, not once per sample. With `sinks`
    (per head) every path takes explicit scores (SDPA has no sink column)."""
    if sinks is not None and dropout:
        raise ValueError("packed attention with attention sinks runs without dropout")
    slots, real = segments[0], segments[1]
    h, d = q.shape[1], q.shape[3]
    n, longest = slots.shape
    windowed = window is not None and window < longest
    by_matmul = sinks is not None or (q.device.type == "cpu" and longest <= MATH_ATTENTION_MAX_LEN and dropout == 0.0)
    rep = h // k.shape[1]
    # Grouped-query attention (query head i reads key/value head i // rep). SDPA's causal flash kernels read
    # each key/value head for its query heads themselves (enable_gqa): a GPU's in bf16 / fp16 (in fp32 it would
    # fall back to the math kernel), and the CPU's in fp32 (in bf16 its grouped backward rounds the key/value
    # gradients twice as much as summing copies does: tests/integration/test_packing.py). The other paths get a
    # copy of each key/value head per query head.
    half = q.dtype in (torch.float16, torch.bfloat16)
    grouped = (rep > 1 and not by_matmul and not windowed and len(segments) == 2
               and (half if q.device.type == "cuda" else q.device.type == "cpu" and q.dtype == torch.float32))
    if rep > 1 and not grouped:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def batch(t: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        n, length = where.shape
        return t[0].index_select(1, where.reshape(-1)).view(t.shape[1], n, length, d).transpose(0, 1)

    if by_matmul:
        out = _causal_math_attention(batch(q, slots), batch(k, slots), batch(v, slots), scaling,
                                     window if windowed else None, sinks)
    elif windowed:  # slots are left-aligned positions within the segment: the window is a band below the diagonal
        out = F.scaled_dot_product_attention(batch(q, slots), batch(k, slots), batch(v, slots),
                                             attn_mask=_visible(longest, window, q.device), dropout_p=dropout,
                                             scale=scaling)
    else:
        out = F.scaled_dot_product_attention(batch(q, slots), batch(k, slots), batch(v, slots), dropout_p=dropout,
                                             is_causal=True, scale=scaling, enable_gqa=grouped)
    flat = out.transpose(0, 1).reshape(h, n * longest, d)
    if len(segments) == 5:
        queries, keys, prefix = segments[2], segments[3], segments[4]
        query_at = prefix[:, None, None] + torch.arange(queries.shape[1], device=q.device)[None, :, None]
        key_at = torch.arange(keys.shape[1], device=q.device)[None, None, :]  # prompt keys, then the sample's own
        visible = key_at <= query_at
        if window is not None:
            visible = visible & (query_at - key_at < window)
        if sinks is not None:
            tail = _math_attention(batch(q, queries), batch(k, keys), batch(v, keys), visible[:, None], scaling, sinks)
        else:
            tail = F.scaled_dot_product_attention(batch(q, queries), batch(k, keys), batch(v, keys),
                                                  attn_mask=visible[:, None], dropout_p=dropout, scale=scaling)
        flat = torch.cat([flat, tail.transpose(0, 1).reshape(h, -1, d)], dim=1)
    return flat.index_select(1, real)[None]  # [1, H, T, d] in row order


# On CPU, short segments (RL prompts and replies of a few dozen tokens) attend faster with plain
# matmuls and a softmax than through SDPA's flash kernel, whose per-call cost dominates there; the
# [segments, heads, L, L] scores stay small below this length.
MATH_ATTENTION_MAX_LEN = 128


def _causal_math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None,
                           window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention [b, H, L, d] as softmax(q k^T * scale, masked) v (what SDPA computes); with `window`,
    each query sees only the keys less than `window` positions back."""
    return _math_attention(q, k, v, _visible(q.shape[2], window, q.device), scaling, sinks)


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scaling: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale where `visible`) v for q [b, H, Lq, d], k/v [b, H, Lk, d]; with `sinks` [H], each
    head's sink logit joins every query's softmax as one more column, whose probability is dropped."""
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = (torch.matmul(q, k.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def _visible(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[length, length] bool: query i sees key j when j <= i (causal) and, with `window`, i - j < window."""
    pos = torch.arange(length, device=device)
    seen = pos[None, :] <= pos[:, None]
    return seen & (pos[:, None] - pos[None, :] < window) if window is not None else seen


def install_packed_attention(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers model) to packed attention; forwards must then pass
    `packed_segments=` (and `sp_group=` under sequence parallelism). Registering under our own
    name changes no other model."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is None:
        model.set_attn_implementation(ATTENTION_NAME)
        return
    # A vision-language model: packed attention in the language model only. The vision tower attends within
    # each image (its own cu_seqlens) with SDPA; the packed rows' keyword arguments pass through it unused.
    model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": "sdpa"})
