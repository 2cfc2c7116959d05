"""The optimizer of a model that trains, its learning-rate schedule, and the clipped optimizer step
(the actor's and the critic's alike). The models themselves: train/models/model_init.py."""
from __future__ import annotations

import math

import torch

from train.parallel.shard_norms import local_pieces, local_square_sum, local_tensor, sum_over_mesh


def build_optimizer(model: torch.nn.Module, lr: float, betas, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, fused (one kernel over all tensors, plain or FSDP's DTensor
    shards alike). Not `foreach`: its step holds a temporary of every second moment's square root at
    once, 4 bytes per trainable parameter; on one H100 a fully fine-tuned 4B model peaked at 75.3 GiB
    in that step, 16 P + 4 P bytes (benchmarks/gpu_suite.py bigmodel)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer, total_updates: int, warmup_ratio: float,
                    kind: str, min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then constant or cosine down to `min_lr_ratio` of the peak."""
    warmup = int(round(warmup_ratio * total_updates))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_updates - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """`offload_optimizer`: Adam moments live on the CPU between steps and visit the device only
    for the step (a no-op when the device is the CPU)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients to a global L2 norm `max_norm`; returns the pre-clip norm (a float32 0-d tensor on the
    gradients' device). Gradients on one device mesh (or none): norms and scaling over each rank's local
    pieces with foreach kernels (train/parallel/shard_norms.py) and one all-reduce per mesh dim, a fixed number
    of kernels whatever the tensor count. On several meshes (expert parallelism: dense weights over fsdp, experts
    over efsdp x ep), or with a Partial gradient, torch's DTensor reductions: each mesh's norm is reduced on its
    own and the squares added. Every gradient is then scaled through its local piece (one foreach op per device,
    any placement) by the same factor, min(1, max_norm / (norm + 1e-6)), as torch's clip_grad_norm_ does."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    meshes = {getattr(g, "device_mesh", None) for g in grads}
    held = local_pieces(grads) if len(meshes) == 1 else None
    if held is not None:
        pieces, copies = held
        norm = sum_over_mesh(local_square_sum(pieces, copies, pieces[0].device), meshes.pop()).sqrt().float()
    else:
        pieces = [local_tensor(g) for g in grads]
        by_mesh: dict[object, list[torch.Tensor]] = {}
        for g in grads:
            by_mesh.setdefault(getattr(g, "device_mesh", None), []).append(g)
        squares = [_whole(torch.nn.utils.get_total_norm(group)).double() ** 2 for group in by_mesh.values()]
        norm = torch.stack(squares).sum().sqrt().float()
    # Every placement scales through its local piece (a Partial one's pending sum too): one foreach op per device.
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for piece in pieces:
        by_device.setdefault(piece.device, []).append(piece)
    for where, group in by_device.items():
        torch._foreach_mul_(group, coef.to(where))
    return norm


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler, max_norm: float,
                  offload_optimizer: bool = False) -> float:
    """Global gradient clipping, then the optimizer step unless the norm is not finite; returns the
    pre-clip norm."""
    norm = clip_grad_norm(list(model.parameters()), max_norm)
    if torch.isfinite(norm):
        if offload_optimizer:
            move_optimizer_state(optimizer, norm.device)
        optimizer.step()
        if offload_optimizer:
            move_optimizer_state(optimizer, "cpu")
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return float(norm)
