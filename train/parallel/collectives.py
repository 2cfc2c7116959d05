"""The collectives the trainer issues itself (besides FSDP's, TP's and Ulysses' inside the model):
a few all-reduces of counts and metrics, and a gather of small log records to rank 0. Each takes a
list of numbers and does one collective, so callers batch what they need into one call.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from train.parallel.distributed import DistContext


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a list of floats over all ranks in one collective (float64 to keep counts exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if _active():
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(value: float, device: torch.device) -> float:
    return all_reduce_max_many([value], device)[0]


def all_reduce_max_many(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max of a list of floats over all ranks, in one collective (min: negate)."""
    if not values:
        return []
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def gather_to_main(obj, ctx: DistContext) -> list | None:
    """Small objects (log samples, events) to rank 0; never used for training data."""
    if ctx.world_size == 1:
        return [obj]
    out = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name now warns on every
# call); torch 2.11 has only the old name.
ALL_GATHER_FLAT = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """`out` = every rank's `inp`, end to end in rank order (one collective)."""
    getattr(dist, ALL_GATHER_FLAT)(out, inp, group=group)


def broadcast_from_main(obj, ctx: DistContext):
    """A small object from rank 0 to every rank (a decision, an error message); never training data."""
    if ctx.world_size == 1:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if _active():
        dist.barrier()


