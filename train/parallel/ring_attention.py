"""Ring attention (context parallelism, `cp_size`): each of the cp ring ranks holds two of a packed row's 2·cp
chunks, zigzag (chunks r and 2·cp−1−r, so every rank has as much causal work); key/value blocks go round the
ring and each rank merges its queries' attention over every block by log-sum-exp.

One ring pass per layer and direction:
- forward: at step s the block of rank (r − s) mod n is here and the next one is in flight; its attention is
  computed tile by tile (`block_kernel`) and merged into a running output and log-sum-exp;
- backward: at step s the next key/value block is in flight while this block's gradients are computed; the
  gradients that the ranks before gave this block arrive meanwhile (sent after their step), are added, and go on
  with it, so each block's key/value gradients reach their owner after the n-th step. Both transfers overlap the
  compute of a block.

A tile's attention runs in one fused call of a flash kernel that returns the log-sum-exp: on CPU
`aten._scaled_dot_product_flash_attention_for_cpu`, which takes a mask (`FlashCPUKernel`); on CUDA torch's flash
kernel for the tiles that need no mask, once it passed its check (`FlashCUDAKernel`); else in plain torch
(`PlainKernel`, any device). All give the same numbers (tests/unit/test_ring_kernels.py); scores are never held
beyond one [heads, tile, tile].
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Query and key tiles of a ring block: at most [heads, tile, tile] scores (plain torch) or a [tile, tile] mask
# (fused) exist at once, whatever the block's length, so attention memory does not grow with the sequence.
RING_TILE = 2048

_KV_TAG, _GRAD_TAG = 0, 1  # the key/value blocks and their gradients travel at the same time in the backward


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
    seq_parallel's `_segment_attention` computes from the slots of the same row."""
    seg: torch.Tensor
    pos: torch.Tensor
    prefix: torch.Tensor

    def visible(self, queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
        pq, pk = self.pos[queries][:, None], self.pos[keys][None, :]
        sk = self.seg[keys][None, :]
        seen = (pk <= pq) & ((sk == self.seg[queries][:, None]) | (sk == self.prefix[queries][:, None]))
        return seen & (pq - pk < window) if window is not None else seen


class PlainKernel:
    """One tile's attention in plain torch, any device: scores in `wide` (float32; float64 for float64)."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, scale: float,
                wide: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """q [H, Lq, d], k/v [H, Lk, d], seen [Lq, Lk] -> this tile's output [H, Lq, d] and log-sum-exp [H, Lq]
        (-inf for a query that sees none of these keys)."""
        scores = (torch.matmul(q, k.transpose(-1, -2)).to(wide) * scale).masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        return torch.matmul(probs.to(v.dtype), v).to(wide), lse

    @staticmethod
    def backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, seen: torch.Tensor, scale: float, wide: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This tile's share of dq, dk, dv given the whole row's output and log-sum-exp (`lse` [H, Lq]) and
        delta = sum(grad · out) [H, Lq]: the probabilities are recomputed, never stored."""
        grad, q, k, v = (t.to(wide) for t in (grad, q, k, v))
        scores = (torch.matmul(q, k.transpose(-1, -2)) * scale).masked_fill(~seen, float("-inf"))
        probs = torch.exp(scores - lse[..., None])
        dv = torch.matmul(probs.transpose(-1, -2), grad)
        dscores = probs * (torch.matmul(grad, v.transpose(-1, -2)) - delta[..., None]) * scale
        return torch.matmul(dscores, k), torch.matmul(dscores.transpose(-1, -2), q), dv


class FlashCPUKernel:
    """One tile's attention in one fused call of torch's CPU flash kernel, which returns the log-sum-exp and
    whose backward takes the whole row's output and log-sum-exp: no scores in Python. A tile every query of
    which sees every key runs unmasked, a square causal one with is_causal, the rest with an additive mask."""
    _forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    @staticmethod
    def _mask(seen: torch.Tensor, dtype: torch.dtype) -> tuple[bool, torch.Tensor | None]:
        causal = _unmasked(seen)
        if causal is not None:
            return causal, None
        return False, torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, float("-inf"))

    @classmethod
    def forward(cls, q, k, v, seen, scale, wide):
        causal, mask = cls._mask(seen, q.dtype)
        out, lse = cls._forward(q[None], k[None], v[None], 0.0, causal, attn_mask=mask, scale=scale)
        # the kernel gives a query that sees nothing an output of 0 and a log-sum-exp of 0: make it -inf
        return out[0].to(wide), lse[0].to(wide).masked_fill(~seen.any(-1), float("-inf"))

    @classmethod
    def backward(cls, grad, q, k, v, out, lse, delta, seen, scale, wide):
        causal, mask = cls._mask(seen, q.dtype)
        dq, dk, dv = cls._backward(grad[None], q[None], k[None], v[None], out[None], lse[None], 0.0, causal,
                                   attn_mask=mask, scale=scale)
        return dq[0].to(wide), dk[0].to(wide), dv[0].to(wide)


def _unmasked(seen: torch.Tensor) -> bool | None:
    """A tile every query of which sees every key: False; a square causal one: True; any other: None."""
    if bool(seen.all()):
        return False
    lq, lk = seen.shape
    return True if lq == lk and torch.equal(seen, torch.ones_like(seen).tril()) else None


class FlashCUDAKernel:
    """One tile in torch's CUDA flash-attention kernel (bf16 / fp16), which returns the log-sum-exp and whose
    backward takes the whole row's output and log-sum-exp. It takes no mask: a tile that needs one (packed
    rows, shared prompts, windows) runs in plain torch; a lone sequence's tiles are whole, causal or unseen."""

    @staticmethod
    def forward(q, k, v, seen, scale, wide):
        causal = _unmasked(seen)
        if causal is None:
            return PlainKernel.forward(q, k, v, seen, scale, wide)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q[None], k[None], v[None], 0.0, causal,
                                                                      False, scale=scale)[:2]
        return out[0].to(wide), lse[0].to(wide)

    @staticmethod
    def backward(grad, q, k, v, out, lse, delta, seen, scale, wide):
        causal = _unmasked(seen)
        if causal is None:
            return PlainKernel.backward(grad, q, k, v, out, lse, delta, seen, scale, wide)
        unused = torch.empty(0, dtype=torch.int64, device=q.device)  # the dropout's seed and offset (no dropout)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad[None], q[None], k[None], v[None], out[None], lse[None].float().contiguous(), None, None,
            q.shape[1], k.shape[1], 0.0, causal, unused, unused, scale=scale)
        return dq[0].to(wide), dk[0].to(wide), dv[0].to(wide)


@torch.no_grad()
def kernel_error(kernel: type, device: torch.device, dtype: torch.dtype, dim: int = 64) -> float:
    """The largest difference of `kernel` from a float64 softmax on small tiles (whole, causal, masked, and one
    whose first query sees nothing: forward only, as in a ring that query sees keys of other tiles), forward
    and backward, relative to each output's scale. The reference's gradients are written out (no autograd): the
    check runs inside the model's first ring forward, which may be a no-grad pass or a checkpointed layer."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 64, dim, generator=g, dtype=torch.float64) for _ in range(4))
    wide, scale = torch.promote_types(dtype, torch.float32), dim ** -0.5
    pos = torch.arange(64)
    causal = pos[None, :] <= pos[:, None]
    masked = causal & ((pos[None, :] % 3 != 0) | (pos[None, :] == pos[:, None]))
    blind = masked & (pos[:, None] != 0)
    worst = 0.0
    for seen in (torch.ones(64, 64, dtype=torch.bool), causal, masked, blind):
        rows = seen.any(-1)
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
        p = torch.softmax(scores, -1).nan_to_num(0.0)
        ref, lse = p @ v, torch.logsumexp(scores, -1)
        on = [t.to(device, dtype) for t in (q, k, v)]
        out, part = kernel.forward(*on, seen.to(device), scale, wide)
        pairs = [(out[:, rows], ref[:, rows]), (part[:, rows], lse[:, rows])]
        if bool(rows.all()):
            delta = (grad * ref).sum(-1)
            ds = p * (grad @ v.transpose(-1, -2) - delta[..., None])  # d loss / d scores
            want = (ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ grad)  # dq, dk, dv
            got = kernel.backward(grad.to(device, dtype), *on, ref.to(device, dtype), lse.to(device, wide),
                                  delta.to(device, wide), seen.to(device), scale, wide)
            pairs += list(zip(got, want))
        for a, b in pairs:
            worst = max(worst, float((a.double().cpu() - b).abs().max() / b.abs().max().clamp_min(1e-12)))
    return worst


@functools.cache
def _cuda_flash_checked(device: torch.device, dtype: torch.dtype, dim: int) -> bool:
    """FlashCUDAKernel on a few small tiles against a float64 softmax, once per device, dtype and head size,
    before any ring uses it: a torch build whose private flash ops changed falls back to plain torch, named."""
    try:
        error = kernel_error(FlashCUDAKernel, device, dtype, dim)
    except Exception as e:  # noqa: BLE001 - any failure of a private op means: do not use it
        print(f"warning: ring attention runs its tiles in plain torch on {device}: torch's flash kernel failed "
              f"its check ({type(e).__name__}: {e})", file=sys.stderr)
        return False
    if error > 0.05:  # bf16 gives ~1e-2; a wrong layout or mask gives O(1)
        print(f"warning: ring attention runs its tiles in plain torch on {device}: torch's flash kernel differs "
              f"from a float64 softmax by {error:.3g}", file=sys.stderr)
        return False
    return True


def block_kernel(device: torch.device, dtype: torch.dtype, dim: int = 64) -> type:
    """The fused kernel where this device has one (CPU; CUDA in bf16 / fp16 once it passed its check), else
    plain torch. `dim`: the head size (CUDA's flash kernel takes multiples of 8 up to 256)."""
    if device.type == "cpu" and dtype in (torch.float32, torch.float64, torch.bfloat16):
        return FlashCPUKernel
    if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and dim % 8 == 0 and dim <= 256
            and _cuda_flash_checked(device, dtype, dim)):
        return FlashCUDAKernel
    return PlainKernel


def _ring_exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup, tag: int = _KV_TAG) -> tuple[list, list]:
    """Send `tensors` to the next ring rank and receive the previous one's, without waiting (wait on the
    returned requests, which keep the sent tensors alive): the transfer overlaps the block being computed."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:  # a ring of one passes to itself
        return tensors, [[], tensors]
    to, frm = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    tensors = [t.contiguous() for t in tensors]
    got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # (empty_like keeps strides)
    ops = [dist.P2POp(dist.isend, t, to, group, tag) for t in tensors]
    ops += [dist.P2POp(dist.irecv, g, frm, group, tag) for g in got]
    return got, [dist.batch_isend_irecv(ops), tensors]


def _wait(requests: list) -> None:
    for request in requests[0]:
        request.wait()


def _tiles(length: int, tile: int) -> list[slice]:
    """Tiles of at most `tile` rows inside each of a chunk's two zigzag halves: a tile then holds consecutive
    positions, so that of a lone sequence is seen whole, causally or not at all (no mask to build)."""
    half = length // 2
    return [slice(i, min(i + tile, start + half)) for start in (0, half) for i in range(start, start + half, tile)]


def _repeat(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t.repeat_interleave(rep, dim=0) if rep > 1 else t


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Key/value-head gradients from query-head ones: a key/value head serves `rep` query heads, whose add."""
    return t.view(-1, rep, *t.shape[1:]).sum(1) if rep > 1 else t


class _RingAttention(torch.autograd.Function):
    """Attention of this rank's queries q [H, C, d] over the whole row, whose keys and values k, v [Hkv, C, d]
    are spread over the ring (rank j holds rows zigzag_rows(j)); see the module's docstring."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: RingRow,
                group: dist.ProcessGroup, scale: float, window: int | None, tile: int, kernel: type) -> torch.Tensor:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        heads, length, _ = q.shape
        rep = heads // k.shape[0]
        mine = zigzag_rows(r, n, length // 2, q.device)
        wide = torch.promote_types(q.dtype, torch.float32)
        # the output so far as sum_i w_i out_i with w_i = exp(lse_i - top), top the largest tile log-sum-exp
        # yet, and total = sum_i w_i: a weight is rescaled only when top moves (as an online softmax)
        acc = torch.zeros(q.shape, dtype=wide, device=q.device)
        top = torch.full((heads, length), float("-inf"), dtype=wide, device=q.device)
        total = torch.zeros((heads, length), dtype=wide, device=q.device)
        block = [k, v]
        for step in range(n):
            keys = zigzag_rows((r - step) % n, n, length // 2, q.device)
            pending = _ring_exchange(block, group) if step < n - 1 else None
            kb, vb = _repeat(block[0], rep), _repeat(block[1], rep)
            for qs in _tiles(length, tile):
                for ks in _tiles(length, tile):
                    seen = row.visible(mine[qs], keys[ks], window)
                    if not seen.any():
                        continue
                    out, part = kernel.forward(q[:, qs], kb[:, ks], vb[:, ks], seen, scale, wide)
                    new_top = torch.maximum(top[:, qs], part)
                    base = torch.where(torch.isinf(new_top), 0.0, new_top)  # queries that have seen nothing yet
                    fade, weight = torch.exp(top[:, qs] - base), torch.exp(part - base)
                    total[:, qs] = total[:, qs] * fade + weight
                    acc[:, qs] = acc[:, qs] * fade[..., None] + out * weight[..., None]
                    top[:, qs] = new_top
            if pending is not None:
                _wait(pending[1])
                block = pending[0]
        out = (acc / total[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, top + torch.log(total))
        ctx.row, ctx.group, ctx.scale, ctx.window, ctx.tile, ctx.kernel = row, group, scale, window, tile, kernel
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        row, group, scale, window, tile, kernel = ctx.row, ctx.group, ctx.scale, ctx.window, ctx.tile, ctx.kernel
        n, r = dist.get_world_size(group), dist.get_rank(group)
        heads, length, _ = q.shape
        rep = heads // k.shape[0]
        mine = zigzag_rows(r, n, length // 2, q.device)
        wide = torch.promote_types(q.dtype, torch.float32)
        grad = grad.contiguous()
        delta = (grad.to(wide) * out.to(wide)).sum(-1)  # [H, C]: sum_j p_ij dO_i . v_j
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        block, arriving = [k, v], None
        for step in range(n):
            keys = zigzag_rows((r - step) % n, n, length // 2, q.device)
            pending = _ring_exchange(block, group) if step < n - 1 else None
            kb, vb = _repeat(block[0], rep), _repeat(block[1], rep)
            dk = torch.zeros(block[0].shape, dtype=wide, device=q.device)
            dv = torch.zeros(block[1].shape, dtype=wide, device=q.device)
            for qs in _tiles(length, tile):
                for ks in _tiles(length, tile):
                    seen = row.visible(mine[qs], keys[ks], window)
                    if not seen.any():
                        continue
                    pq, pk, pv = kernel.backward(grad[:, qs], q[:, qs], kb[:, ks], vb[:, ks], out[:, qs],
                                                 lse[:, qs], delta[:, qs], seen, scale, wide)
                    dq[:, qs] += pq
                    dk[:, ks] += _fold(pk, rep)
                    dv[:, ks] += _fold(pv, rep)
            if arriving is not None:  # what the ranks before gave this block, sent while we computed
                _wait(arriving[1])
                dk += arriving[0][0]
                dv += arriving[0][1]
            # on to the block's next holder; after the last step that is its owner
            arriving = _ring_exchange([dk, dv], group, _GRAD_TAG)
            if pending is not None:
                _wait(pending[1])
                block = pending[0]
        _wait(arriving[1])
        dk, dv = arriving[0]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row: RingRow,
                   group: dist.ProcessGroup, scaling: float | None, window: int | None, tile: int = RING_TILE,
                   kernel: type | None = None) -> torch.Tensor:
    """[1, H, C, d] queries of this rank's zigzag chunk, [1, Hkv, C, d] keys and values -> [1, H, C, d].
    `kernel`: PlainKernel, FlashCPUKernel or FlashCUDAKernel (default: `block_kernel` for the device)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kernel = kernel or block_kernel(query.device, query.dtype, query.shape[-1])
    return _RingAttention.apply(query[0], key[0], value[0], row, group, scale, window, tile, kernel)[None]
