"""The optimizer of a model that trains, its learning-rate schedule, and the clipped optimizer step
(the actor's and the critic's alike). The models themselves: train/models/model_init.py."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from train.models.memory_plan import MOMENT_BUCKET_BYTES
from train.parallel.shard_norms import local_pieces, local_square_sum, local_tensor, sum_over_mesh
from train.utils.host_slab import HostSlab


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


class HostMoments:
    """`offload_optimizer`: between steps the optimizer's state tensors (AdamW's two moments, 8 bytes per
    trainable fp32 parameter; not its step counts) live on the host, and the step runs a bucket of parameters at
    a time, so at most MOMENT_BUCKET_BYTES of moments are on the device at once: a bucket's moments come over,
    its parameters step, its moments go back (into the bucket's slab, train/utils/host_slab.py: exactly their
    bytes, page-locked on CUDA, laid out at the first step and reused). The step is AdamW's own, elementwise per
    parameter, so stepping the buckets one after the other gives the same numbers as one step over all. The
    tensor objects stay in the optimizer's state (a DTensor's local piece is what moves), so checkpoints, the
    governor's snapshots and `load_state_dict` see the same state on either side. On a CPU the same copies run
    (out of the slab into fresh memory for the step, and back), so the CPU tests check the path a GPU takes."""

    def __init__(self, optimizer: torch.optim.Optimizer, bucket_bytes: int | None = None) -> None:
        self.optimizer = optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # where the step runs: the parameters' device
        self.device = local_tensor(params[0]).device if params else torch.device("cpu")
        limit = bucket_bytes or MOMENT_BUCKET_BYTES
        self.buckets: list[list[torch.Tensor]] = []
        size = limit
        for p in params:  # in order; a parameter whose moments exceed the limit has a bucket of its own
            moments = 2 * local_tensor(p).numel() * p.element_size()
            if size + moments > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += moments
        self.slabs = [HostSlab(pin=self.device.type == "cuda") for _ in self.buckets]

    def pieces(self) -> list[torch.Tensor]:
        """Every state tensor's local piece, bucket by bucket."""
        return [piece for bucket in self.buckets for piece in self._pieces(bucket)]

    def _pieces(self, bucket: list[torch.Tensor]) -> list[torch.Tensor]:
        """The local pieces (a DTensor's shard, a plain tensor itself) of the bucket's state tensors."""
        return [local_tensor(value) for p in bucket for key, value in self.optimizer.state.get(p, {}).items()
                if isinstance(value, torch.Tensor) and key != "step"]

    def step(self) -> None:
        """The optimizer step, a bucket at a time (the other parameters' gradients hidden, so AdamW skips them);
        returns when the moments are back on the host (a checkpoint may read them next)."""
        self._step_by_bucket(lambda p, grad: grad)

    def materialize(self) -> None:
        """Make the state where it waits, a bucket at a time, where there is none yet (before the first step).
        A checkpoint's save or load reads the state through DCP, which would otherwise make all of it on the
        device at once, with one step over zero gradients of every parameter (`_init_optim_state`): here the
        same step at learning rate 0 (the parameters unchanged), bucket by bucket, each bucket's state sent to
        its slab."""
        if self.optimizer.state or any(p.grad is not None for bucket in self.buckets for p in bucket):
            return  # (made already, or gradients are being accumulated: DCP then leaves the state alone too)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        try:
            for group in self.optimizer.param_groups:
                group["lr"] = 0.0
            self._step_by_bucket(lambda p, grad: torch.zeros_like(p) if p.requires_grad else None)
        finally:
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr

    @torch.no_grad()
    def _step_by_bucket(self, grad_of: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor | None]) -> None:
        """One optimizer step per bucket with gradients (`grad_of(param, its gradient)`; the others' are hidden):
        the bucket's state pieces come over from the host, AdamW steps them, they go back into its slab. Every
        gradient is as it was afterwards."""
        grads = {p: p.grad for bucket in self.buckets for p in bucket}
        try:
            for p in grads:
                p.grad = None
            for bucket, slab in zip(self.buckets, self.slabs):
                given = [grad_of(p, grads[p]) for p in bucket]
                if all(g is None for g in given):
                    continue
                for p, grad in zip(bucket, given):
                    p.grad = grad
                for piece in self._pieces(bucket):  # (a first step creates them on the device)
                    if piece.device.type == "cpu":
                        piece.data = piece.data.to(self.device, non_blocking=True, copy=True)
                self.optimizer.step()
                self._to_host(bucket, slab)
                for p in bucket:
                    p.grad = None
        finally:
            for p, grad in grads.items():
                p.grad = grad
        self._wait()

    @contextlib.contextmanager
    def kept_in_place(self) -> Iterator[None]:
        """Around DCP's set_state_dict in a checkpoint's load. dcp.load has written the loaded values into the
        state tensors themselves, in the host slabs; torch's Optimizer.load_state_dict would then copy each of
        them to its parameter's device (for fp32 masters, plain tensors: all the moments on the device at once).
        So the state it is given is left out and the live one put back after it: only the param groups load."""
        live = dict(self.optimizer.state)

        def leave_out_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
            return {**state_dict, "state": {}}

        def put_back(optimizer: torch.optim.Optimizer) -> None:
            optimizer.state.update(live)

        hooks = [self.optimizer.register_load_state_dict_pre_hook(leave_out_state),
                 self.optimizer.register_load_state_dict_post_hook(put_back)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    @torch.no_grad()
    def offload(self) -> None:
        """Every state tensor to the host (after a checkpoint's load, which puts them on the device)."""
        for bucket, slab in zip(self.buckets, self.slabs):
            self._to_host(bucket, slab)
        self._wait()

    def _to_host(self, bucket: list[torch.Tensor], slab: HostSlab) -> None:
        pieces = self._pieces(bucket)
        if pieces:
            for piece, host in zip(pieces, slab.hold(pieces)):
                piece.data = host  # its device memory goes back to the allocator (reused by later work only)

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def host_bytes(self) -> int:
        """What the slabs hold (0 before the first step)."""
        return sum(slab.nbytes for slab in self.slabs)

    def device_bytes(self) -> int:
        """Bytes of state tensors not in a slab (on the device, or on a CPU outside the slabs)."""
        return sum(piece.numel() * piece.element_size() for bucket, slab in zip(self.buckets, self.slabs)
                   for piece in self._pieces(bucket) if not slab.holds(piece))


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
                  host_moments: HostMoments | None = None) -> float:
    """Global gradient clipping, then the optimizer step unless the norm is not finite; returns the
    pre-clip norm. `host_moments` (offload_optimizer): the step a bucket of parameters at a time, the state
    coming from the host and going back."""
    norm = clip_grad_norm(list(model.parameters()), max_norm)
    if torch.isfinite(norm):
        if host_moments is not None:
            host_moments.step()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return float(norm)
