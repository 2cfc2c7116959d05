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
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

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


def _blocks(ws: list[torch.Tensor], in_place_words: float) -> list[torch.Tensor]:
    """The words of `ws` laid out in whole blocks, zero-padded per tensor, in order: [*, BLOCK] int32
    pieces. Consecutive small tensors share one buffer (one copy); a tensor of `in_place_words` or more is
    a view of its whole blocks and a copy of its last, partial one only."""
    pad = torch.zeros(BLOCK, dtype=torch.int32, device=ws[0].device)
    pieces: list[torch.Tensor] = []
    small: list[torch.Tensor] = []

    def tail(w: torch.Tensor) -> None:
        if w.numel() % BLOCK:
            small.append(pad[: BLOCK - w.numel() % BLOCK])

    for w in ws:
        if w.numel() < in_place_words:
            small.append(w)
            tail(w)
            continue
        if small:
            pieces.append(torch.cat(small).view(-1, BLOCK))
            small = []
        whole = w.numel() // BLOCK * BLOCK
        if whole:
            pieces.append(w[:whole].view(-1, BLOCK))
        if whole < w.numel():
            small.append(w[whole:])
            tail(w)
    if small:
        pieces.append(torch.cat(small).view(-1, BLOCK))
    return pieces


def _group(tensors: Sequence[torch.Tensor], chunk_bytes: int) -> torch.Tensor:
    """Checksums of tensors on one device with a fixed number of kernels: [len(tensors)] int64."""
    device = tensors[0].device
    ws = [words(t) for t in tensors]
    counts = [-(-w.numel() // BLOCK) for w in ws]
    out = torch.tensor([t.numel() * t.element_size() * LENGTH_MIX for t in tensors], dtype=torch.int64,
                       device=device)
    if not any(counts):
        return out  # empty tensors only
    in_place = min(IN_PLACE_BYTES.get(device.type, chunk_bytes), chunk_bytes) // 4
    terms = [_block_terms(p) for p in _blocks(ws, in_place)]
    block_sum = torch.cat([s for s, _ in terms]) if len(terms) > 1 else terms[0][0]
    inner = torch.cat([i for _, i in terms]) if len(terms) > 1 else terms[0][1]
    owner = torch.repeat_interleave(torch.arange(len(ws), device=device), torch.tensor(counts, device=device))
    starts = torch.tensor([0, *itertools.accumulate(counts)][:-1], dtype=torch.int64, device=device)
    index = torch.arange(owner.numel(), device=device) - starts[owner]  # each block's index in its tensor
    return out.index_add_(0, owner, (index + BLOCK_MIX) * block_sum + inner)


def checksums(tensors: Sequence[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """The checksum of each tensor (module docstring): [len(tensors)] int64 on the first tensor's device,
    no host sync. Consecutive tensors on one device are taken together, up to `chunk_bytes` per group."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    parts: list[torch.Tensor] = []
    group: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if group and (size + nbytes > chunk_bytes or t.device != group[0].device):
            parts.append(_group(group, chunk_bytes))
            group, size = [], 0
        group.append(t)
        size += nbytes
    parts.append(_group(group, chunk_bytes))
    device = tensors[0].device
    return torch.cat([p.to(device) for p in parts]) if len(parts) > 1 else parts[0]


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """One tensor's checksum: a 0-dim int64 tensor on its device (no host sync)."""
    return checksums([tensor])[0]
