"""Dtype-grouped, size-capped weight buckets (train/engines/weight_buckets.py)."""
from __future__ import annotations

import pytest
import torch

from train.engines.weight_buckets import iter_buckets, tensor_nbytes


def named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.int64, torch.float16, torch.float32]
    for i in range(40):
        n = int(torch.randint(1, 900, (1,), generator=g))
        out.append((f"layer{i}.w", torch.zeros(n, dtype=dtypes[i % len(dtypes)])))
    out.append(("huge", torch.zeros(5000, dtype=torch.float32)))  # 20000 bytes: above the cap
    return out


@pytest.mark.parametrize("cap", [1, 1000, 4096, 10**9])
def test_every_tensor_once_single_dtype_and_under_cap(cap: int) -> None:
    tensors = named()
    buckets = list(iter_buckets(iter(tensors), cap))
    names = [n for b in buckets for n in b.names]
    assert sorted(names) == sorted(n for n, _ in tensors)  # every tensor exactly once
    assert len(names) == len(set(names))
    for b in buckets:
        assert {t.dtype for _, t in b.named_tensors} == {b.dtype}
        assert b.nbytes == sum(tensor_nbytes(t) for _, t in b.named_tensors)
        assert b.nbytes <= cap or len(b.named_tensors) == 1  # only a lone oversized tensor exceeds it
    # Within one dtype, arrival order is kept.
    for dtype in {t.dtype for _, t in tensors}:
        want = [n for n, t in tensors if t.dtype == dtype]
        assert [n for b in buckets if b.dtype == dtype for n in b.names] == want


def test_buckets_are_full_and_streamed() -> None:
    # Equal 400-byte tensors, cap 1000: two per bucket, the bucket leaves as soon as the third comes.
    seen: list[str] = []

    def stream():
        for i in range(5):
            seen.append(f"t{i}")
            yield f"t{i}", torch.zeros(100, dtype=torch.float32)

    sizes = []
    for b in iter_buckets(stream(), 1000):
        sizes.append((len(b.named_tensors), len(seen)))
    assert sizes == [(2, 3), (2, 5), (1, 5)]


def test_duplicate_names_and_bad_cap_are_errors() -> None:
    with pytest.raises(ValueError, match="twice"):
        list(iter_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], 100))
    with pytest.raises(ValueError, match="cap"):
        list(iter_buckets([], 0))
