"""Ring attention's tile kernels (train/parallel/ring_attention.py) against a float64 softmax: a tile's output and
log-sum-exp, and its share of dq, dk, dv given the whole row's output and log-sum-exp; the kernel each device
gets. The ring around them is tested in tests/integration/test_context_parallel.py."""
import pytest
import torch

from train.parallel import ring_attention as ring

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("kernel", [ring.PlainKernel, ring.FlashCPUKernel], ids=lambda k: k.__name__)
def test_each_tile_kernel_is_a_float64_softmax_forward_and_backward(kernel, dtype):
    """Whole, causal and masked tiles, and one whose first query sees nothing (its log-sum-exp must be -inf)."""
    assert ring.kernel_error(kernel, torch.device("cpu"), dtype) < TOLERANCE[dtype]
    q = torch.randn(2, 4, 8, dtype=dtype)
    seen = torch.ones(4, 4, dtype=torch.bool).tril()
    seen[0] = False
    _, lse = kernel.forward(q, q, q, seen, 1.0, torch.promote_types(dtype, torch.float32))
    assert torch.isneginf(lse[:, 0]).all() and torch.isfinite(lse[:, 1:]).all()


class _MaskBlind(ring.PlainKernel):
    """A broken kernel: it attends to every key of the tile."""

    @staticmethod
    def forward(q, k, v, seen, scale, wide):
        return ring.PlainKernel.forward(q, k, v, torch.ones_like(seen), scale, wide)


def test_the_kernel_check_runs_where_the_first_ring_forward_runs():
    """On CUDA the check runs inside the model's first ring forward: a no-grad pass (the old or reference
    log-probs) or a checkpointed layer of the update. There it must give what it gives alone, and leave the
    checkpoint's saved tensors as they were (else the backward fails: a different number of tensors saved)."""
    from torch.utils.checkpoint import checkpoint

    alone = ring.kernel_error(ring.PlainKernel, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        assert ring.kernel_error(ring.PlainKernel, torch.device("cpu"), torch.float32) == alone
    with torch.inference_mode():
        assert ring.kernel_error(ring.PlainKernel, torch.device("cpu"), torch.float32) == alone
    x = torch.randn(4, 4, requires_grad=True)
    found = []

    def layer(t):
        found.append(ring.kernel_error(ring.PlainKernel, torch.device("cpu"), torch.float32))
        return (t @ t).sin()

    checkpoint(layer, x, use_reentrant=False).sum().backward()  # the forward, then its recompute
    assert found == [alone, alone] and x.grad is not None


def test_the_kernel_checks_reference_gradients_are_autograds():
    """kernel_error writes the float64 softmax's gradients out: they are autograd's (checked here through a kernel
    that returns autograd's own, so the error is only the forward's rounding)."""
    class Autograd(ring.PlainKernel):
        @staticmethod
        def backward(grad, q, k, v, out, lse, delta, seen, scale, wide):
            with torch.enable_grad():  # (kernel_error runs under no_grad)
                leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
                scores = (leaves[0] @ leaves[1].transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
                ((torch.softmax(scores, -1) @ leaves[2]) * grad.double()).sum().backward()
            return tuple(t.grad for t in leaves)

    assert ring.kernel_error(Autograd, torch.device("cpu"), torch.float64) < 1e-12


def test_the_kernel_check_catches_a_kernel_that_ignores_the_mask():
    assert ring.kernel_error(_MaskBlind, torch.device("cpu"), torch.float32) > 0.05


def test_the_cpu_runs_the_fused_kernel_in_the_trainers_dtypes():
    cpu = torch.device("cpu")
    assert all(ring.block_kernel(cpu, dt) is ring.FlashCPUKernel for dt in (torch.float32, torch.bfloat16))
    assert ring.block_kernel(cpu, torch.float16) is ring.PlainKernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("dim", [64, 128])
def test_cuda_runs_torchs_flash_kernel_per_tile_and_it_is_a_float64_softmax(dim):
    cuda = torch.device("cuda")
    assert ring.kernel_error(ring.FlashCUDAKernel, cuda, torch.bfloat16, dim) < TOLERANCE[torch.bfloat16]
    assert ring.block_kernel(cuda, torch.bfloat16, dim) is ring.FlashCUDAKernel
    assert ring.block_kernel(cuda, torch.float32, dim) is ring.PlainKernel
