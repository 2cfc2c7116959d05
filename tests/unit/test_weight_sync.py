"""The push's gather on one rank (train/parallel/weight_sync.py, what PolicySync.push calls): whole tensors that
need the engine's dtype are cast a bucket at a time, one kernel per bucket whatever its tensor count;
the others travel as they are. The sharded paths (FSDP on 2 and 3 ranks, HSDP, TP) are checked against
`full_tensor()` in tests/integration/test_distributed.py."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.parallel.weight_sync import gather_full_tensors


class Ops(TorchDispatchMode):
    """The ops that run (views apart: they launch no kernel and allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.nn.Parameter(torch.randn(7, 5, generator=g))) for i in range(40)]
    named += [
        ("transposed", torch.randn(6, 4, generator=g).t()),  # not contiguous
        ("scalar", torch.tensor(1.2345678)),
        ("empty", torch.zeros(0, 3)),
        ("steps", torch.arange(5)),  # not floating: never cast
        ("already_bf16", torch.randn(3, 3, generator=g).to(torch.bfloat16)),
    ]
    return named


def test_one_rank_casts_take_one_multi_tensor_copy_per_bucket():
    named = _named()
    bucket_bytes = 1000  # 40 x 70 bf16 bytes: several buckets
    with torch.no_grad(), Ops() as counted:
        got = list(gather_full_tensors(named, bucket_bytes, torch.bfloat16))
    assert sorted(n for n, _ in got) == sorted(n for n, _ in named)  # every tensor exactly once
    source = dict(named)
    for name, tensor in got:
        want = source[name].detach()
        want = want.to(torch.bfloat16) if want.is_floating_point() else want
        assert tensor.dtype == want.dtype and tensor.shape == want.shape and torch.equal(tensor, want), name
        assert not tensor.requires_grad, name
    out = dict(got)
    # what needs no cast is not copied
    for name in ("steps", "already_bf16"):
        assert out[name].data_ptr() == source[name].data_ptr(), name
    # each cast tensor is its own (a consumer holding one does not hold its bucket), allocated without a kernel,
    # and filled by one multi-tensor copy per bucket, whatever the number of tensors in it
    cast = [t for n, t in got if n not in ("steps", "already_bf16")]
    assert all(t._base is None for t in cast) and len({t.data_ptr() for t in cast if t.numel()}) == len(cast) - 1
    buckets = -(-sum(t.numel() * 2 for t in cast) // bucket_bytes)
    assert counted.ops.count("aten.empty") == len(cast)
    assert buckets <= counted.ops.count("aten._foreach_copy_") <= 2 * buckets + 1
    assert set(counted.ops) == {"aten.empty", "aten._foreach_copy_"}, counted.ops


def test_without_a_dtype_every_tensor_travels_as_it_is():
    named = _named()
    with torch.no_grad(), Ops() as counted:
        got = list(gather_full_tensors(named, 1000))
    assert [n for n, _ in got] == [n for n, _ in named]  # nothing bucketed: the same order
    for (_, tensor), (_, source) in zip(got, named):
        assert tensor.data_ptr() == source.data_ptr() and tensor.dtype == source.dtype
    assert counted.ops == []
