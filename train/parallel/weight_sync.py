"""Full weights for the rollout engine, gathered in flat buckets: one collective per bucket.

A model under FSDP2 holds each parameter as a DTensor sharded on dim 0 over the FSDP ranks (and
replicated over the `ddp` ranks of hybrid sharding). Gathering them one by one costs one collective
per tensor (hundreds for a 7B model). Here the local shards of many tensors are cast to the
engine's dtype, padded to equal chunks and laid end to end in one flat buffer per bucket (one
dtype, at most `bucket_bytes` of full tensors); one `all_gather_into_tensor` over the shard group
brings every rank's chunks, and the full tensors are cut out of the result. Memory per rank is the
bucket (and its gathered copy), never the whole model.

Tensors sharded some other way (tensor parallelism, several sharded mesh dims) fall back to
`DTensor.full_tensor()` one by one. Plain tensors (one rank, no sharding) are yielded as they are,
cast only when the engine's dtype differs: no gather and at most one copy.

Every rank must iterate `gather_full_tensors` to the end, in the same order (it is collective).
Tensors that need no bucket come out at once, so the output order may differ from the input's.
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from train.parallel.collectives import all_gather_flat


@dataclass
class _Pending:
    name: str
    local: torch.Tensor  # this rank's shard, dim 0 padded to `chunk` rows, cast
    shape: torch.Size  # the full tensor's shape
    chunk: int  # rows per rank (ceil(dim0 / group size))


def _shard_group(tensor: torch.Tensor):
    """(process group, size) when `tensor` is a DTensor sharded on dim 0 over exactly one mesh dim and
    replicated over the others (FSDP2, HSDP); else None."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return None
    mesh = tensor.device_mesh
    sharded = [i for i, p in enumerate(placements) if p.is_shard() and mesh.size(i) > 1]
    if len(sharded) != 1 or not placements[sharded[0]].is_shard(dim=0):
        return None
    if not all(p.is_replicate() or mesh.size(i) == 1 for i, p in enumerate(placements) if i != sharded[0]):
        return None
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


def _flush(bucket: list[_Pending], group, size: int) -> Iterator[tuple[str, torch.Tensor]]:
    flat = torch.cat([p.local.reshape(-1) for p in bucket])
    out = flat.new_empty(size * flat.numel())
    all_gather_flat(out, flat, group=group)
    per_rank = out.view(size, flat.numel())
    offset = 0
    for p in bucket:
        n = p.local.numel()
        rows = per_rank[:, offset:offset + n].reshape(size * p.chunk, *p.shape[1:])
        offset += n
        yield p.name, rows[: p.shape[0]]  # a view: the consumer copies it into its own storage


def gather_full_tensors(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                        dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every (name, tensor), floating tensors cast to `dtype` (None: as they
    are), sharded ones gathered in flat buckets of at most `bucket_bytes`. Tensors come out bucket by
    bucket: a bucket's tensors are views of one buffer, valid until the iteration moves on. Run it
    under `torch.no_grad()`, where a DTensor's local tensor is read without autograd's bookkeeping
    (~50 us per tensor otherwise, most of a small model's push)."""
    open_buckets: dict[tuple, _Bucket] = {}  # one open bucket per (dtype, shard group)
    layouts: dict[tuple, tuple | None] = {}  # _shard_group per (mesh, placements): a push has a handful
    for name, tensor in named:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        placements = getattr(tensor, "placements", None)
        key = None if placements is None else (id(tensor.device_mesh), placements)
        if key not in layouts:
            layouts[key] = _shard_group(tensor)
        info = layouts[key]
        if info is None:
            if placements is not None:  # a DTensor (under no_grad, to_local is an attribute read)
                if all(not p.is_shard() or tensor.device_mesh.size(i) == 1 for i, p in enumerate(placements)):
                    tensor = tensor.to_local()  # a mesh of one rank: the local tensor is the whole
                else:  # TP (with FSDP: a strided shard): one collective
                    with _quiet_strided_gather():
                        tensor = tensor.full_tensor()
            tensor = tensor.detach()
            yield name, tensor if tensor.dtype == cast else tensor.to(cast)
            continue
        group, size = info
        local = tensor.to_local().detach()
        shape = tensor.shape
        chunk = -(-shape[0] // size)
        padded = local.new_zeros((chunk, *shape[1:]), dtype=cast)
        padded[: local.shape[0]] = local  # FSDP2 shards like torch.chunk: the last ranks may hold fewer rows
        key = (cast, id(group))
        bucket = open_buckets.setdefault(key, _Bucket(group, size))
        full = padded.numel() * size * padded.element_size()
        if bucket.items and bucket.nbytes + full > bucket_bytes:
            yield from _flush(bucket.items, group, size)
            bucket.items, bucket.nbytes = [], 0
        bucket.items.append(_Pending(name, padded, shape, chunk))
        bucket.nbytes += full
    for bucket in open_buckets.values():  # the partial ones, in the order they were opened
        if bucket.items:
            yield from _flush(bucket.items, bucket.group, bucket.size)


@dataclass
class _Bucket:
    group: object
    size: int
    items: list[_Pending] = field(default_factory=list)
    nbytes: int = 0


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
