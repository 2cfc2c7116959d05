"""An exact checksum of a tensor's values, equal wherever the same values are held (any device, any
grouping): what the trainer sent and what the rollout engine holds are compared with it.

Definition. The tensor's bytes (row-major, whatever its memory layout) are read as little-endian
32-bit words, zero-padded to whole blocks of 32 rows x 32 words. In block b, R[b, r] is the sum of
row r, C[b, c] the sum of column c and S_b the sum of the block, all with int32 wrap-around (exact
modular arithmetic in any order, as fast as a float sum). Then, with int64 wrap-around,

    checksum = nbytes * LENGTH_MIX
               + sum_b [ (b + BLOCK_MIX) * S_b + sum_r (r + 1) * R[b, r] + COLUMN_MIX * sum_c (c + 1) * C[b, c] ]

Every word of a block has its own coefficient, so a flipped bit, swapped words or rows, a transpose
or a tensor cut short all change the checksum.

`checksums` takes many tensors at once with a fixed number of kernels per group of tensors (at most
`chunk_bytes`, copied once into one buffer), not per tensor: a push of a model's ~300 tensors costs a
few dozen kernel launches instead of ~2,000, and memory beyond the tensors is one chunk. On CPU,
where a call costs little and a copy much, a tensor of 256 KB or more is read in place instead.
A `Checksummer` does the same and keeps each group's layout in its buffer between calls, so the push
after the first costs no Python per tensor: what the trainer and the engine use.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SIDE = 32  # a block is SIDE rows of SIDE words
BLOCK = SIDE * SIDE
BLOCK_MIX = 1_000_003
COLUMN_MIX = 2_654_435_761  # odd, > SIDE: keeps row and column coefficients apart
LENGTH_MIX = 40_503
CHUNK_BYTES = 128 << 20  # tensors copied together into one buffer (more: fewer kernels, more memory)
IN_PLACE_BYTES = {"cpu": 256 << 10}  # per device type: tensors at least this large are not copied


def words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-d int32 tensor (a view when they are whole, aligned words; else a
    copy, zero-padded to a whole word)."""
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    flat = t.reshape(-1)  # copies only when the tensor is not contiguous
    size = flat.element_size()
    nbytes = flat.numel() * size
    if nbytes % 4 == 0 and (size >= 4 or flat.storage_offset() * size % 4 == 0):
        return flat.view(torch.int32)
    raw = flat.view(torch.uint8)
    return torch.cat([raw, raw.new_zeros((-nbytes) % 4)]).view(torch.int32)


def _block_terms(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of `blocks` ([n, BLOCK] int32): S_b, and the rows' and columns' terms, both [n] int64."""
    grid = blocks.view(-1, SIDE, SIDE)
    rows = grid.sum(dim=2, dtype=torch.int32)  # R[b, r]
    cols = grid.sum(dim=1, dtype=torch.int32)  # C[b, c]
    block_sum = rows.sum(dim=1, dtype=torch.int32).to(torch.int64)  # S_b
    weights = torch.arange(1, SIDE + 1, dtype=torch.int64, device=blocks.device)
    return block_sum, (rows.to(torch.int64) * weights).sum(1) + COLUMN_MIX * (cols.to(torch.int64) * weights).sum(1)


@dataclass(repr=False)  # its views' memory may be released
class _Plan:
    """Where one group's tensors go in a staging buffer, kept for the next group of the same shapes."""
    staging: torch.Tensor  # the uint8 buffer the views below are views of
    staged: list[int]  # indices of the tensors copied whole into the staging buffer
    large: list[tuple[int, int]]  # (index, whole-block words) of tensors read in place, tails staged
    dsts: list[torch.Tensor]  # staging views: one per staged tensor (its dtype and shape), then each large tail (int32)
    pads: list[torch.Tensor]  # the staging bytes between a region's data and its region's end: zeroed every call
    blocks: torch.Tensor  # the staged regions as [n, BLOCK] int32
    base: torch.Tensor  # nbytes * LENGTH_MIX per tensor, int64
    owner: torch.Tensor  # per block (staged blocks first, then each large tensor's whole blocks): its tensor
    index: torch.Tensor  # per block: its index in its tensor


class Checksummer:
    """`checksums` that keeps each group's layout between calls: a push sends the same shapes every time,
    so after the first one a group costs two multi-tensor calls (zero the padding, copy every small tensor
    into a staging buffer at a fixed place) and a fixed number of kernels, with no Python per tensor beyond
    the key of its shape. The staging buffer is one per device, at most `chunk_bytes` plus 4 KB per tensor
    (one group), whatever the model's size; `release()` frees its memory between pushes. Tensors of
    `IN_PLACE_BYTES` or more (on CUDA: `chunk_bytes`) are read where they are, only their last partial
    block staged. Not thread-safe: one per caller."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, max_plans: int = 1024) -> None:
        self.chunk_bytes, self.max_plans = chunk_bytes, max_plans
        self._plans: dict[tuple, _Plan] = {}
        self._staging: dict[torch.device, torch.Tensor] = {}

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The checksum of each tensor (module docstring): [len(tensors)] int64 on the first tensor's
        device, no host sync. Consecutive tensors on one device are taken together, up to `chunk_bytes`
        per group."""
        if not tensors:
            return torch.zeros(0, dtype=torch.int64)
        parts: list[torch.Tensor] = []
        group: list[torch.Tensor] = []
        size = 0
        with torch.no_grad():
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                if group and (size + nbytes > self.chunk_bytes or t.device != group[0].device):
                    parts.append(self._group(group))
                    group, size = [], 0
                group.append(t)
                size += nbytes
            parts.append(self._group(group))
        device = tensors[0].device
        return torch.cat([p.to(device) for p in parts]) if len(parts) > 1 else parts[0]

    def _group(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        device = tensors[0].device
        staging = self._staging.get(device)
        if staging is not None and staging.untyped_storage().nbytes() < staging.numel():
            staging.untyped_storage().resize_(staging.numel())  # released: memory again, its views stay valid
        key = (device, *((t.dtype, t.shape) for t in tensors))
        plan = self._plans.get(key)
        if plan is None or plan.staging is not staging:
            plan = self._plan(tensors, device)
            if len(self._plans) >= self.max_plans:
                self._plans.clear()
            self._plans[key] = plan
        if not plan.owner.numel():
            return plan.base.clone()  # empty tensors only
        if plan.pads:
            torch._foreach_zero_(plan.pads)
        srcs = [tensors[i] for i in plan.staged]
        wholes = [words(tensors[i]) for i, _ in plan.large]
        srcs += [w[whole:] for w, (_, whole) in zip(wholes, plan.large) if whole < w.numel()]
        if srcs:
            torch._foreach_copy_(plan.dsts, srcs)
        pieces = [plan.blocks] if plan.blocks.numel() else []
        pieces += [w[:whole].view(-1, BLOCK) for w, (_, whole) in zip(wholes, plan.large) if whole]
        terms = [_block_terms(p) for p in pieces]
        block_sum = torch.cat([b for b, _ in terms]) if len(terms) > 1 else terms[0][0]
        inner = torch.cat([i for _, i in terms]) if len(terms) > 1 else terms[0][1]
        return plan.base.clone().index_add_(0, plan.owner, (plan.index + BLOCK_MIX) * block_sum + inner)

    def release(self) -> None:
        """Free the staging buffers' device memory until the next call, keeping the layouts: their views stay
        valid and get memory back (the storage is resized, as FSDP2 frees an unsharded parameter). Host
        buffers stay: on CPU only small tensors are staged, and allocating them again costs more than they hold."""
        for device, staging in self._staging.items():
            if device.type != "cpu":
                staging.untyped_storage().resize_(0)

    def _plan(self, tensors: list[torch.Tensor], device: torch.device) -> _Plan:
        """Lay the group out: each small tensor in a region of whole blocks of the staging buffer, each large
        one's tail in one block; the staged blocks come first in the block order, then the large tensors'."""
        in_place = min(IN_PLACE_BYTES.get(device.type, self.chunk_bytes), self.chunk_bytes)
        block_bytes = BLOCK * 4
        regions: list[tuple[int, int, int]] = []  # (tensor index, data bytes, region bytes), staged order
        large: list[tuple[int, int]] = []
        tails: list[tuple[int, int, int]] = []  # (tensor index, its whole-block words, its tail's bytes)
        for i, t in enumerate(tensors):
            nbytes = t.numel() * t.element_size()
            if nbytes >= in_place:
                n_words = -(-nbytes // 4)
                whole = n_words // BLOCK * BLOCK
                large.append((i, whole))
                if whole < n_words:
                    tails.append((i, whole, (n_words - whole) * 4))
            elif nbytes:
                regions.append((i, nbytes, -(-nbytes // block_bytes) * block_bytes))
        needed = sum(r for _, _, r in regions) + block_bytes * len(tails)
        staging = self._staging.get(device)
        if staging is None or staging.numel() < needed:
            staging = self._staging[device] = torch.empty(max(needed, 1), dtype=torch.uint8, device=device)
            self._plans = {k: p for k, p in self._plans.items() if k[0] != device}  # their views are of the old one
        dsts: list[torch.Tensor] = []
        pads: list[torch.Tensor] = []
        owner: list[int] = []
        index: list[int] = []
        offset = 0
        for i, nbytes, region in regions:
            t = tensors[i]
            raw = staging[offset:offset + nbytes]
            dsts.append(raw.view(t.dtype).view(t.shape))  # region offsets are whole blocks: aligned for any dtype
            pads.append(staging[offset + nbytes:offset + region])
            owner += [i] * (region // block_bytes)
            index += range(region // block_bytes)
            offset += region
        for i, whole, tail_bytes in tails:
            dsts.append(staging[offset:offset + tail_bytes].view(torch.int32))
            pads.append(staging[offset + tail_bytes:offset + block_bytes])
            owner.append(i)
            index.append(whole // BLOCK)
            offset += block_bytes
        blocks = staging[:offset].view(torch.int32).view(-1, BLOCK)
        for i, whole in large:
            owner += [i] * (whole // BLOCK)
            index += range(whole // BLOCK)
        base = torch.tensor([t.numel() * t.element_size() * LENGTH_MIX for t in tensors], dtype=torch.int64,
                            device=device)
        return _Plan(staging, [i for i, _, _ in regions], large, dsts, [p for p in pads if p.numel()], blocks, base,
                     torch.tensor(owner, dtype=torch.int64, device=device),
                     torch.tensor(index, dtype=torch.int64, device=device))


def checksums(tensors: Sequence[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """The checksum of each tensor (module docstring), computed once (a `Checksummer` of its own): [len(tensors)]
    int64 on the first tensor's device, no host sync."""
    return Checksummer(chunk_bytes)(tensors)


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """One tensor's checksum: a 0-dim int64 tensor on its device (no host sync)."""
    return checksums([tensor])[0]
