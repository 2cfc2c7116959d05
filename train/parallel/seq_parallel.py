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
heads); key/value blocks go round the ring, each rank merging its queries' attention over every block
with an online softmax (`_RingAttention`), and the backward sends the blocks' key/value gradients round
after them, back to their owners.

Nothing is patched at import: `install_packed_attention(model)` registers the function under its
own name and switches that model to it; the segments (`packed_segments`) and the sp process group
(`sp_group`) travel with each forward call as keywords.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

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


def zigzag_rows(rank: int, n: int, half: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The row positions ring rank `rank` of `n` holds: half chunks `rank` and 2n−1−rank of `half` tokens."""
    first, second = rank * half, (2 * n - 1 - rank) * half
    return torch.cat([torch.arange(first, first + half), torch.arange(second, second + half)]).to(device)


@dataclass(frozen=True)
class RingRow:
    """A packed row under ring attention: what decides which key a query sees, for every row position.
    `seg`: its segment (a sample, a shared prompt, the end padding); `pos`: its position id; `prefix`: the
    segment of the shared prompt its sample continues (-1: none). Query i sees key j when pos[j] <= pos[i]
    and j is in i's segment or in i's prompt, and (sliding window) pos[i] - pos[j] < window: what
    `_segment_attention` computes from the slots of the same row."""
    seg: torch.Tensor
    pos: torch.Tensor
    prefix: torch.Tensor

    def visible(self, queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
        pq, pk = self.pos[queries][:, None], self.pos[keys][None, :]
        sk = self.seg[keys][None, :]
        seen = (pk <= pq) & ((sk == self.seg[queries][:, None]) | (sk == self.prefix[queries][:, None]))
        return seen & (pq - pk < window) if window is not None else seen


def _ring_exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[list[torch.Tensor], list]:
    """Send `tensors` to the next ring rank and receive the previous one's, without waiting (wait on the
    returned requests): the transfer overlaps the block being computed."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    to, frm = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    tensors = [t.contiguous() for t in tensors]
    got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # (empty_like keeps strides)
    ops = [dist.P2POp(dist.isend, t, to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, g, frm, group) for g in got]
    return got, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


# Query and key tiles of a ring block: the scores held at once are [heads, tile, tile] (float32), whatever the
# block's length, so attention memory does not grow with the sequence per rank.
RING_TILE = 1024


def _tiles(length: int, tile: int) -> list[slice]:
    return [slice(i, min(i + tile, length)) for i in range(0, length, tile)]


class _RingAttention(torch.autograd.Function):
    """Attention of this rank's queries q [H, C, d] over the whole row, whose keys and values k, v [Hkv, C, d]
    are spread over the ring (rank j holds rows zigzag_rows(j)). Forward: n steps; at step s the block of
    rank (r − s) mod n is here, the next one in flight; scores in float32 (float64 for float64) merged tile by
    tile by an online softmax (running max and sum), tiles no query of which sees a key skipped. The backward
    recomputes each tile's probabilities from the saved log-sum-exp, and the block's key/value gradients
    travel with it, arriving home after the n-th pass. Nothing of size T² is kept: one tile's scores at a
    time."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: RingRow,
                group: dist.ProcessGroup, scale: float, window: int | None, tile: int) -> torch.Tensor:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        heads, length, _ = q.shape
        rep = heads // k.shape[0]
        mine = zigzag_rows(r, n, length // 2, q.device)
        wide = torch.promote_types(q.dtype, torch.float32)  # scores and sums: float32, or float64 for float64
        acc = torch.zeros(q.shape, dtype=wide, device=q.device)
        top = torch.full((heads, length), float("-inf"), dtype=wide, device=q.device)
        total = torch.zeros((heads, length), dtype=wide, device=q.device)
        block = [k, v]
        for step in range(n):
            keys = zigzag_rows((r - step) % n, n, length // 2, q.device)
            pending = _ring_exchange(block, group) if step < n - 1 else None
            kb, vb = (t.repeat_interleave(rep, dim=0) if rep > 1 else t for t in block)
            for qs in _tiles(length, tile):
                for ks in _tiles(length, tile):
                    seen = row.visible(mine[qs], keys[ks], window)
                    if not seen.any():
                        continue
                    scores = (torch.matmul(q[:, qs], kb[:, ks].transpose(-1, -2)).to(wide) * scale
                              ).masked_fill(~seen, float("-inf"))
                    new_top = torch.maximum(top[:, qs], scores.amax(-1))
                    base = torch.where(torch.isinf(new_top), 0.0, new_top)  # rows that have seen nothing yet
                    probs = torch.exp(scores - base[..., None])
                    fade = torch.exp(top[:, qs] - base)
                    total[:, qs] = total[:, qs] * fade + probs.sum(-1)
                    acc[:, qs] = acc[:, qs] * fade[..., None] + torch.matmul(probs.to(vb.dtype), vb[:, ks]).to(wide)
                    top[:, qs] = new_top
            if pending is not None:
                _wait(pending[1])
                block = pending[0]
        out = (acc / total[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, top + torch.log(total))
        ctx.row, ctx.group, ctx.scale, ctx.window, ctx.tile = row, group, scale, window, tile
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        row, group, scale, window, tile = ctx.row, ctx.group, ctx.scale, ctx.window, ctx.tile
        n, r = dist.get_world_size(group), dist.get_rank(group)
        heads, length, dim = q.shape
        rep = heads // k.shape[0]
        mine = zigzag_rows(r, n, length // 2, q.device)
        wide = torch.promote_types(q.dtype, torch.float32)
        grad, qw = grad.to(wide), q.to(wide)
        delta = (grad * out.to(wide)).sum(-1)  # [H, C]: sum_j p_ij dO_i . v_j
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        block = [k, v, torch.zeros(k.shape, dtype=wide, device=q.device),
                 torch.zeros(v.shape, dtype=wide, device=q.device)]
        for step in range(n):
            keys = zigzag_rows((r - step) % n, n, length // 2, q.device)
            kb, vb = (t.repeat_interleave(rep, dim=0).to(wide) if rep > 1 else t.to(wide) for t in block[:2])
            for qs in _tiles(length, tile):
                for ks in _tiles(length, tile):
                    seen = row.visible(mine[qs], keys[ks], window)
                    if not seen.any():
                        continue
                    scores = (torch.matmul(qw[:, qs], kb[:, ks].transpose(-1, -2)) * scale
                              ).masked_fill(~seen, float("-inf"))
                    probs = torch.exp(scores - lse[:, qs, None])
                    dv = torch.matmul(probs.transpose(-1, -2), grad[:, qs])
                    dscores = probs * (torch.matmul(grad[:, qs], vb[:, ks].transpose(-1, -2)) - delta[:, qs, None]) * scale
                    dq[:, qs] += torch.matmul(dscores, kb[:, ks])
                    dk = torch.matmul(dscores.transpose(-1, -2), qw[:, qs])
                    if rep > 1:  # a key/value head serves `rep` query heads: their gradients add
                        dk, dv = (t.view(-1, rep, *t.shape[1:]).sum(1) for t in (dk, dv))
                    block[2][:, ks] += dk
                    block[3][:, ks] += dv
            # pass the block on with its gradients; after the n-th pass each block's gradients are home
            got, requests = _ring_exchange(block if step < n - 1 else block[2:], group)
            _wait(requests)
            block = got if step < n - 1 else [k, v, *got]
        return dq.to(q.dtype), block[2].to(k.dtype), block[3].to(v.dtype), None, None, None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row: RingRow,
                   group: dist.ProcessGroup, scaling: float | None, window: int | None) -> torch.Tensor:
    """[1, H, C, d] queries of this rank's zigzag chunk, [1, Hkv, C, d] keys and values -> [1, H, C, d]."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _RingAttention.apply(query[0], key[0], value[0], row, group, scale, window, RING_TILE)[None]


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
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # grouped-query attention: query head h reads key/value head h // rep
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    h, d = q.shape[1], q.shape[3]

    def batch(t: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        n, length = where.shape
        return t[0].index_select(1, where.reshape(-1)).view(h, n, length, d).transpose(0, 1)

    n, longest = slots.shape
    windowed = window is not None and window < longest
    if sinks is not None or (q.device.type == "cpu" and longest <= MATH_ATTENTION_MAX_LEN and dropout == 0.0):
        out = _causal_math_attention(batch(q, slots), batch(k, slots), batch(v, slots), scaling,
                                     window if windowed else None, sinks)
    elif windowed:  # slots are left-aligned positions within the segment: the window is a band below the diagonal
        out = F.scaled_dot_product_attention(batch(q, slots), batch(k, slots), batch(v, slots),
                                             attn_mask=_visible(longest, window, q.device), dropout_p=dropout,
                                             scale=scaling)
    else:
        out = F.scaled_dot_product_attention(batch(q, slots), batch(k, slots), batch(v, slots), dropout_p=dropout,
                                             is_causal=True, scale=scaling)
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
