"""Full weights for the rollout engine, gathered in flat buckets: one collective per bucket.

A model under FSDP2 holds each parameter as a DTensor sharded on dim 0 over the FSDP ranks (and
replicated over the `ddp` ranks of hybrid sharding). Gathering them one by one costs one collective
per tensor (hundreds for a 7B model). Here the local shards of many tensors (one dtype, at most
`bucket_bytes` of full tensors) are cast to the engine's dtype and padded to equal chunks in one
multi-tensor copy into one flat buffer; one `all_gather_into_tensor` over the shard group brings every
rank's chunks, and one more copy (`split_with_sizes_copy`) puts each tensor's chunks side by side in
its own output. A bucket costs a fixed number of kernels whatever its tensor count (on one GPU that count,
not the bytes, set the push's time). Memory per rank is about two buckets (the gathered bucket and the
outputs cut from it, plus the flat piece, bucket / ranks), never the whole model.

Tensors sharded some other way (tensor parallelism, several sharded mesh dims) fall back to
`DTensor.full_tensor()` one by one. Whole tensors (one rank, no sharding) are yielded as they are when
the engine's dtype is theirs (no copy); otherwise a bucket of them is cast in one multi-tensor copy (no gather).

Every rank must iterate `gather_full_tensors` to the end, in the same order (it is collective).
Tensors that need no bucket come out at once, so the output order may differ from the input's.
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from train.parallel.collectives import all_gather_flat


WHOLE, FULL_TENSOR = "whole", "full_tensor"  # how a tensor that no bucket gathers is read (see _route)


def _route(tensor: torch.Tensor):
    """How `tensor` travels: (process group, size) when it is a DTensor sharded on dim 0 over exactly one mesh
    dim of more than one rank and replicated over the others (FSDP2, HSDP: gathered in buckets); WHOLE when it
    is a plain tensor or a DTensor whose shards are all on this rank (its local tensor is the whole);
    FULL_TENSOR otherwise (tensor parallelism: `full_tensor()`, one collective)."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return WHOLE
    mesh = tensor.device_mesh
    sharded = [i for i, p in enumerate(placements) if p.is_shard() and mesh.size(i) > 1]
    if not sharded:
        return WHOLE
    if len(sharded) != 1 or not placements[sharded[0]].is_shard(dim=0):
        return FULL_TENSOR
    if not all(p.is_replicate() or mesh.size(i) == 1 for i, p in enumerate(placements) if i != sharded[0]):
        return FULL_TENSOR
    return mesh.get_group(sharded[0]), mesh.size(sharded[0])


# FSDP over tensor parallelism shards a TP-sharded dim 0 again (`_StridedShard`); gathering it whole takes
# two all-gathers, which DTensor announces on every rank ("While redistributing from (_StridedShard(...),
# Shard(dim=0)) to (Replicate(), Replicate()), 2 sequential all_gather operations ..."). It is the
# gather asked for here (no single collective can do it), so that one message is dropped, only here.
_STRIDED_GATHER = re.compile(r"While redistributing from \(_StridedShard\(.*sequential all_gather operations")


class _ExpectedStridedGather(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _STRIDED_GATHER.search(record.getMessage())


_EXPECTED = _ExpectedStridedGather()


@contextlib.contextmanager
def _quiet_strided_gather() -> Iterator[None]:
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    logger.addFilter(_EXPECTED)
    try:
        yield
    finally:
        logger.removeFilter(_EXPECTED)


@dataclass
class _Pending:
    name: str
    local: torch.Tensor  # this rank's shard (a whole tensor when unsharded), not yet cast
    shape: torch.Size  # the full tensor's shape
    chunk: int  # rows per rank (ceil(dim0 / group size)); unused when unsharded


@dataclass
class _Bucket:
    """The tensors waiting to travel together: one dtype, one shard group (None: unsharded, to be cast only), one
    device (the mesh's for a DTensor: FSDP2's CPU offload keeps the shards in host memory, and NCCL gathers
    device memory; so the bucket is filled on the GPU, one host-to-device copy per bucket)."""
    dtype: torch.dtype
    group: object
    size: int  # ranks in the group (1 when unsharded)
    device: torch.device
    items: list[_Pending] = field(default_factory=list)
    nbytes: int = 0  # of full tensors


def _mesh_device(mesh) -> torch.device:
    """The device a mesh's collectives run on (this process's current one of its type)."""
    kind = mesh.device_type
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def _rows(p: _Pending, size: int) -> int:
    """Elements of one rank's padded chunk of `p` (its whole tensor when unsharded)."""
    return p.local.numel() if size == 1 else p.chunk * math.prod(p.shape[1:])


def _flush(bucket: _Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """One multi-tensor copy casts every local piece into one flat buffer, one collective gathers it over the
    shard group, and one more copy puts each tensor's chunks side by side in its own output: a fixed number of
    kernels per bucket. The outputs are separate tensors, not views of one buffer, so a consumer still copying
    the last few tensors of a bucket holds those, not the whole bucket, while the next one is gathered."""
    items, size, device = bucket.items, bucket.size, bucket.device
    if size == 1:  # cast only: each tensor straight into its output
        outs = [torch.empty(p.local.shape, dtype=bucket.dtype, device=device) for p in items]
        torch._foreach_copy_(outs, [p.local for p in items])
        yield from zip((p.name for p in items), outs)
        return
    counts = [_rows(p, size) for p in items]
    flat = torch.empty(sum(counts), dtype=bucket.dtype, device=device)
    dsts, srcs = [], []
    for p, piece in zip(items, flat.split(counts)):
        # FSDP2 shards like torch.chunk: only the last ranks may hold fewer rows, so the padding rows (left
        # as they are) fall after the tensor's end once gathered, and are cut off there.
        held = p.local.numel()
        if held:
            dsts.append((piece if held == piece.numel() else piece[:held]).view(p.local.shape))
            srcs.append(p.local)
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    gathered = flat.new_empty(size * flat.numel())
    all_gather_flat(gathered, flat, group=bucket.group)
    del flat, dsts
    # Rank-major after the gather (every rank's chunk of every tensor): one copy brings each tensor's chunks together.
    fulls = [torch.empty((size * p.chunk, *p.shape[1:]), dtype=bucket.dtype, device=device) for p in items]
    torch.split_with_sizes_copy(gathered.view(size, -1), counts, dim=1,
                                out=[full.view(size, n) for full, n in zip(fulls, counts)])
    del gathered
    for p, full in zip(items, fulls):  # the padded rows, then the tensor's own
        yield p.name, full if full.shape[0] == p.shape[0] else full[: p.shape[0]]


def gather_full_tensors(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                        dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every (name, tensor), floating tensors cast to `dtype` (None: as they
    are), sharded ones gathered in flat buckets of at most `bucket_bytes`, whole ones that need a cast cast
    a bucket at a time too. Tensors come out bucket by bucket, each a fresh tensor of its own. Run it under
    `torch.no_grad()`, where a DTensor's local tensor is read without autograd's bookkeeping (~50 us per
    tensor otherwise, most of a small model's push)."""
    open_buckets: dict[tuple, _Bucket] = {}  # one open bucket per (dtype, shard group, device)
    routes: dict[tuple, tuple] = {}  # (_route, its bucket's device) per (mesh, placements): a push has a handful
    for name, tensor in named:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        placements = getattr(tensor, "placements", None)
        key = None if placements is None else (id(tensor.device_mesh), placements)
        known = routes.get(key)
        if known is None:
            known = routes[key] = (_route(tensor), None if placements is None else _mesh_device(tensor.device_mesh))
        route, device = known
        if isinstance(route, tuple):  # sharded on dim 0: gathered in a bucket of its shard group
            group, size = route
            local = tensor.to_local()
            local = local.detach() if local.requires_grad else local
        else:
            if route == FULL_TENSOR:  # TP (with FSDP: a strided shard)
                with _quiet_strided_gather():
                    tensor = tensor.full_tensor()
            elif placements is not None:  # WHOLE: under no_grad, to_local is an attribute read
                tensor = tensor.to_local()
            if tensor.requires_grad:  # a plain parameter (a DTensor's local tensor does not)
                tensor = tensor.detach()
            if tensor.dtype == cast:
                yield name, tensor  # no copy at all
                continue
            group, size, local = None, 1, tensor  # cast in a bucket of its own kind, no gather
        shape = tensor.shape
        chunk = -(-shape[0] // size) if size > 1 else 0
        if device is None:  # a plain tensor's bucket: where it is
            device = local.device
        bucket = open_buckets.get((cast, id(group), device))
        if bucket is None:
            bucket = open_buckets[(cast, id(group), device)] = _Bucket(cast, group, size, device)
        item = _Pending(name, local, shape, chunk)
        full = _rows(item, size) * size * cast.itemsize
        if bucket.items and bucket.nbytes + full > bucket_bytes:
            yield from _flush(bucket)
            bucket.items, bucket.nbytes = [], 0
        bucket.items.append(item)
        bucket.nbytes += full
    for bucket in open_buckets.values():  # the partial ones, in the order they were opened
        if bucket.items:
            yield from _flush(bucket)


def unique_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state-dict entries, each storage once (tied embeddings travel once; the
    receiver's copy is tied too). The parameters themselves, not detached copies: detaching a DTensor
    costs a dispatch per tensor, and the consumer only reads them."""
    seen: set[int] = set()
    for name, value in model.state_dict(keep_vars=True).items():
        local = value.to_local() if hasattr(value, "to_local") else value
        key = local.untyped_storage().data_ptr() if local.numel() else id(value)
        if key in seen:
            continue
        seen.add(key)
        yield name, value
