"""The update's weight norm and gradient clipping (train/parallel/shard_norms.py, train/models/optim.py) against
float64 references, and the number of ops they dispatch: fixed, whatever the number of tensors (on a GPU each op
is a kernel launch; per-tensor arithmetic made the weight norms 3,484 of a one-pack update's 18,375 ops at 0.5B)."""
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.models import optim
from train.models.trainable import Trainable


class CountOps(TorchDispatchMode):
    """The aten ops dispatched (a foreach op counts once: on CUDA it is one multi-tensor kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def model_of(n: int, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(3 + i % 5, 2 + i % 3, generator=g)) for i in range(n)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return torch.nn.ParameterList(params)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_scales_every_gradient_by_the_float64_factor(max_norm):
    model = model_of(12)
    grads = [p.grad.double().clone() for p in model.parameters()]
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
    norm_before = optim.clip_grad_norm(list(model.parameters()), max_norm)
    assert norm_before.dtype == torch.float32 and float(norm_before) == pytest.approx(norm, rel=1e-6)
    factor = min(1.0, max_norm / (norm + 1e-6))
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad.double(), g * factor, rtol=1e-6, atol=1e-7)
    if max_norm > norm:  # nothing to clip: the gradients are untouched, bit for bit
        assert all(torch.equal(p.grad, g.float()) for p, g in zip(model.parameters(), grads))


def test_a_non_finite_gradient_gives_a_non_finite_norm_so_the_step_is_skipped():
    model = model_of(4)
    model[2].grad[0, 0] = float("inf")
    assert not torch.isfinite(optim.clip_grad_norm(list(model.parameters()), 1.0))


def test_weight_norm_and_clipping_dispatch_the_same_ops_for_8_tensors_as_for_200():
    counts = {}
    for n in (8, 200):
        model = model_of(n)
        holder = SimpleNamespace(model=model, device=torch.device("cpu"), masters=None)
        with CountOps() as ops:
            Trainable.local_weight_square(holder)
            optim.clip_grad_norm(list(model.parameters()), 0.1)
        counts[n] = ops.count
    assert counts[8] == counts[200] and counts[8] < 40, counts
