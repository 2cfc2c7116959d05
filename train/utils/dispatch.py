"""Spreading rollout samples over data-parallel groups for a model pass, and bringing results home.

Every rank rolls out its own prompts, so its samples are its own. A model pass (log-probs, values,
an update) needs each dp group (the sp * tp ranks that share data) to hold the same samples, and
the groups to carry similar token counts. `Dispatch` all-gathers the samples' lengths, assigns
every sample to a group by token count (deterministically, so every rank agrees without asking),
moves the samples' tensors with one all-gather of flat float64 buffers (no pickling, no rank 0
funnel), and sends each group's results back to the samples' owners the same way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from train.utils.packing import balance
from train.utils.parallel import Layout


def all_gather_ragged(items: list[torch.Tensor], device: torch.device) -> list[list[torch.Tensor]]:
    """Each rank's list of 1-D float64 tensors (any lengths, any count) -> every rank's lists."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return [list(items)]
    sizes = torch.tensor([len(items)] + [t.numel() for t in items], dtype=torch.long, device=device)
    count = torch.tensor([len(items)], dtype=torch.long, device=device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    width = 1 + max(int(c) for c in counts)
    padded = torch.zeros(width, dtype=torch.long, device=device)
    padded[: sizes.numel()] = sizes
    all_sizes = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(all_sizes, padded)
    totals = [int(s[1: 1 + int(s[0])].sum()) for s in all_sizes]
    flat = torch.zeros(max(max(totals), 1), dtype=torch.float64, device=device)
    if items:
        flat[: totals[dist.get_rank()]] = torch.cat([t.to(device, torch.float64) for t in items])
    all_flat = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(all_flat, flat)
    out = []
    for s, data in zip(all_sizes, all_flat):
        lens = s[1: 1 + int(s[0])].tolist()
        out.append(list(torch.split(data[: sum(lens)].cpu(), lens)) if lens else [])
    return out


def encode(parts: list[torch.Tensor]) -> torch.Tensor:
    """Several 1-D tensors of one sample -> one float64 buffer with their lengths up front
    (float64 holds token ids and float32 values exactly)."""
    lens = torch.tensor([p.numel() for p in parts], dtype=torch.float64)
    return torch.cat([lens, *[p.reshape(-1).double().cpu() for p in parts]])


def decode(buf: torch.Tensor, n_parts: int) -> list[torch.Tensor]:
    lens = buf[:n_parts].long().tolist()
    return list(torch.split(buf[n_parts:], lens))


class Dispatch:
    """The assignment of every rank's samples to dp groups for one pass (a collective to build)."""

    def __init__(self, local_lengths: list[int], layout: Layout, device: torch.device):
        self.layout, self.device = layout, device
        gathered = all_gather_ragged([torch.tensor(local_lengths, dtype=torch.float64)], device)
        per_rank = [g[0].long().tolist() if g else [] for g in gathered]
        self.n_local = len(local_lengths)
        self.owners = [(r, j) for r, lens in enumerate(per_rank) for j in range(len(lens))]
        self.groups = balance([n for lens in per_rank for n in lens], layout.sizes.dp)  # global ids per dp group
        self.mine = self.groups[layout.dp_rank]

    def scatter(self, fields: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """Per field, one 1-D tensor per local sample (every rank names the same fields, samples or
        not) -> per field, the float64 tensors of this rank's dp group's samples, in `self.mine` order."""
        names = list(fields)
        records = [encode([fields[name][j] for name in names]) for j in range(self.n_local)]
        everything = all_gather_ragged(records, self.device)
        flat = [buf for rank_bufs in everything for buf in rank_bufs]
        decoded = [decode(flat[g], len(names)) for g in self.mine]
        return {name: [parts[k] for parts in decoded] for k, name in enumerate(names)}

    def gather(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """One 1-D result per sample of `self.mine` (only the group's leader rank sends) -> the
        results for this rank's own samples, in their original order."""
        sent = [r.reshape(-1) for r in results] if self.layout.is_data_leader else []
        everything = all_gather_ragged(sent, self.device)
        by_global: dict[int, torch.Tensor] = {}
        for group_rank, bufs in enumerate(everything):
            if not bufs:
                continue
            dp_index = _dp_index_of(group_rank, self.layout)
            for g, buf in zip(self.groups[dp_index], bufs):
                by_global[g] = buf
        rank = dist.get_rank() if dist.is_initialized() else 0
        out = [by_global[g] for g, (owner, _) in enumerate(self.owners) if owner == rank]
        return [t.float() for t in out]


def _dp_index_of(rank: int, layout: Layout) -> int:
    """The dp index of a global rank: ranks are laid out (dp, sp, tp) with tp innermost."""
    return rank // (layout.sizes.sp * layout.sizes.tp)

