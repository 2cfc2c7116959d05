"""Squared L2 norms of tensors held as shards (FSDP2 / TP DTensors, or plain tensors), computed on each
rank's local pieces with foreach kernels: a fixed number of kernels per device whatever the tensor count.
Per-tensor arithmetic dispatches several ops per tensor instead (the update's weight norms were 3,484 of the
18,375 ops of a one-pack update at Qwen2.5-0.5B's 290 tensors, each a kernel launch on a GPU:
benchmarks/update_ops.py).

Summed over the ranks of the tensors' device mesh, each rank's share gives the global sum: a piece held
by c ranks (Replicate over mesh dims of sizes multiplying to c) counts 1/c on each of them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t` (a DTensor's local tensor, whatever its placement), or `t` itself. Scaling it in
    place scales the whole DTensor, a Partial one's pending sum included (torch 2.11's DTensor `_foreach_mul_`
    leaves a Partial tensor unscaled)."""
    return t._local_tensor if getattr(t, "placements", None) is not None else t  # to_local(): an op per tensor


def local_pieces(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]] | None:
    """Each tensor's local piece and the number of ranks of its mesh that hold the same piece; None when a
    piece is Partial (a pending sum over ranks, whose norm is not the sum of its pieces' norms)."""
    pieces, copies = [], []
    for t in tensors:
        placements = getattr(t, "placements", None)
        if placements is None:
            pieces.append(t)
            copies.append(1)
            continue
        held = 1
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                return None
            if placement.is_replicate():
                held *= t.device_mesh.size(dim)
        pieces.append(local_tensor(t))
        copies.append(held)
    return pieces, copies


@torch.no_grad()
def local_square_sum(pieces: list[torch.Tensor], copies: list[int], device: torch.device) -> torch.Tensor:
    """This rank's share of the squared L2 norm of the pieces (float64, 0-d, on `device`): each piece's norm
    accumulated in float32 (whatever its dtype), squared, divided by its copies and summed in float64."""
    groups: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    for piece, held in zip(pieces, copies):
        groups.setdefault((piece.device, held), []).append(piece)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (_, held), group in groups.items():
        norms = torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).double()
        total += (norms.square().sum() / held).to(device)
    return total


def sum_over_mesh(value: torch.Tensor, mesh) -> torch.Tensor:
    """All-reduce (sum) `value` over every rank of `mesh` (one small collective per dim of size > 1), on the mesh's
    device type (offloaded shards are on the host, NCCL reduces on the GPU); as it is without a mesh."""
    if mesh is None or mesh.size() == 1:
        return value
    on_mesh = value.to(mesh.device_type)
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(on_mesh, group=mesh.get_group(dim))
    return on_mesh.to(value.device)
