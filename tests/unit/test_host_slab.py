"""The engine sleep's host slab (train/utils/host_slab.py): exact bytes, one buffer, values bit for bit."""
from __future__ import annotations

import mmap

import pytest
import torch

from train.utils import host_slab
from train.utils.host_slab import ALIGN, HostSlab, slab_layout


def mixed_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes
        torch.randn(7, generator=g),  # 28
        torch.randint(-2**40, 2**40, (2, 2), generator=g),  # int64, 32
        torch.rand(9, generator=g) > 0.5,  # bool, 9
        torch.tensor(3.25, dtype=torch.float64),  # 0-dim, 8
        torch.empty(0, 4, dtype=torch.float16),  # nothing
        torch.randn(130, 2, generator=g).t(),  # not contiguous, 1,040
    ]


def test_the_layout_rounds_each_tensor_up_to_the_alignment_and_nothing_more():
    offsets, total = slab_layout(mixed_tensors(0))
    # written out: 30, 28, 32, 9 and 8 bytes each take one 512-byte line, the empty tensor none, 1,040 three
    assert offsets == [0, 512, 1024, 1536, 2048, 2560, 2560]
    assert total == 2560 + 3 * 512
    assert ALIGN == 512


def test_hold_copies_every_tensor_bit_for_bit_into_one_buffer_of_the_layouts_size():
    tensors = mixed_tensors(1)
    slab = HostSlab()
    views = slab.hold(tensors)
    assert slab.nbytes == slab_layout(tensors)[1] and not slab.pinned
    base = views[0].untyped_storage().data_ptr()
    for view, tensor, at in zip(views, tensors, slab_layout(tensors)[0]):
        assert view.dtype == tensor.dtype and view.shape == tensor.shape and view.is_contiguous()
        assert torch.equal(view, tensor)
        assert view.untyped_storage().data_ptr() == base  # one buffer
        if tensor.numel():
            assert view.data_ptr() - base == at
    views[1].add_(1)  # a view is the slab's memory, not a copy of it
    assert not torch.equal(views[1], tensors[1])


def test_the_same_shapes_again_reuse_the_buffer_and_new_shapes_get_a_new_one():
    slab = HostSlab()
    first = slab.hold(mixed_tensors(2))
    base = first[0].untyped_storage().data_ptr()
    again = mixed_tensors(3)
    second = slab.hold(again)
    assert second[0].untyped_storage().data_ptr() == base  # laid out once: no new allocation (no new pinning)
    assert all(torch.equal(v, t) for v, t in zip(second, again))
    old = [v.clone() for v in second]
    other = [torch.ones(1000, dtype=torch.bfloat16)]
    third = slab.hold(other)
    assert slab.nbytes == 2048 and torch.equal(third[0], other[0])
    # the earlier views keep their memory and values (a caller still using them is not corrupted)
    assert all(torch.equal(v, o) for v, o in zip(second, old))
    slab.release()
    assert slab.nbytes == 0 and torch.equal(third[0], other[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_a_pinned_slab_holds_cuda_tensors_in_page_locked_memory_of_exactly_their_bytes():
    tensors = [t.cuda() for t in mixed_tensors(4)]
    slab = HostSlab(pin=True)
    views = slab.hold(tensors)
    torch.cuda.synchronize()
    assert slab.pinned and slab.nbytes == -(-slab_layout(tensors)[1] // mmap.PAGESIZE) * mmap.PAGESIZE
    assert views[0].data_ptr() % mmap.PAGESIZE == 0  # whole pages of its own
    assert all(v.is_pinned() and v.device.type == "cpu" for v in views)
    assert all(torch.equal(v, t.cpu()) for v, t in zip(views, tensors))
    back = [v.to("cuda", non_blocking=True) for v in views]
    torch.cuda.synchronize()
    assert all(torch.equal(b, t) for b, t in zip(back, tensors))
    slab.release()
    assert not slab.pinned


def test_a_pinned_slab_registers_whole_pages_once_per_layout_and_unregisters_what_it_drops(monkeypatch):
    # cudaHostRegister needs CUDA: recording fakes stand in for the two cudart calls (the test above runs them)
    calls = []
    monkeypatch.setattr(host_slab, "_register", lambda b: calls.append(("register", b.data_ptr(), b.numel())) or True)
    monkeypatch.setattr(host_slab, "_unregister", lambda b: calls.append(("unregister", b.data_ptr(), b.numel())))
    slab = HostSlab(pin=True)
    tensors = mixed_tensors(5)
    views = slab.hold(tensors)
    slab.hold(mixed_tensors(6))
    assert [c[0] for c in calls] == ["register"]  # the same layout again: registered once
    _, ptr, size = calls[0]
    assert ptr % mmap.PAGESIZE == 0 and size % mmap.PAGESIZE == 0 and size >= slab_layout(tensors)[1]
    assert views[0].data_ptr() == ptr and slab.pinned
    slab.hold([torch.zeros(10)])
    assert calls[1] == ("unregister", ptr, size) and calls[2][0] == "register"
    slab.release()
    assert calls[3] == ("unregister", calls[2][1], calls[2][2]) and not slab.pinned and len(calls) == 4
