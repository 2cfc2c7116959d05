"""One exactly sized block of host memory that holds copies of many device tensors (the `hf` engine's sleep).

torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of two, so a model's weights
copied one tensor at a time take up to twice their bytes of page-locked host memory (a 64 MiB + 1 byte
tensor takes 128 MiB; one 9 GiB block, 16 GiB). A slab is one pageable buffer of exactly the tensors' bytes,
each start aligned to ALIGN bytes (whole pages of its own when pinned), page-locked in place with
`cudaHostRegister` (pin=True), and reused by every later `hold` of tensors of the same shapes and dtypes: the
registration is paid once per run.
"""
from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

ALIGN = 512  # bytes: every tensor starts on this boundary (any dtype's element size divides it; whole DMA lines)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def slab_layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the slab, in order, and the slab's size (every size rounded up to ALIGN)."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-tensor_bytes(tensor) // ALIGN) * ALIGN
    return offsets, end


class HostSlab:
    """Host copies of a list of tensors in one buffer; `pin`: page-lock it for asynchronous copies (CUDA only).

    `hold(tensors)` copies them in and returns one host view per tensor; the views stay valid until the next
    `hold` or `release`. Copies from a CUDA device into a pinned slab are queued on the current stream: the
    caller synchronizes before reading the views (the engine does before it frees device memory)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._buffer: torch.Tensor | None = None
        self._key: tuple | None = None
        self._offsets: list[int] = []
        self._registered = False

    @property
    def nbytes(self) -> int:
        """The host bytes held: the layout's size, rounded up to whole pages when pinned (0 before the first
        `hold` and after `release`)."""
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked (pin=True, and something to hold)."""
        return self._registered

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view of this slab's buffer."""
        return self._buffer is not None and tensor.untyped_storage().data_ptr() == \
            self._buffer.untyped_storage().data_ptr()

    def hold(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy `tensors` into the slab (laid out anew only when their shapes or dtypes changed) and return
        the host views, each with its tensor's shape and dtype."""
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        if key != self._key:
            self.release()
            self._offsets, total = slab_layout(tensors)
            buffer = _page_aligned(total) if self.pin else torch.empty(total, dtype=torch.uint8, device="cpu")
            self._registered = self.pin and total > 0 and _register(buffer)
            self._buffer, self._key = buffer, key
        assert self._buffer is not None
        views = [self._buffer[at:at + tensor_bytes(t)].view(t.dtype).view(t.shape)
                 for at, t in zip(self._offsets, tensors)]
        with torch.no_grad():
            for view, tensor in zip(views, tensors):
                view.copy_(tensor, non_blocking=self._registered)
        return views

    def release(self) -> None:
        """Unregister and drop the buffer (views still in use keep its memory alive, unpinned). Copies queued
        from or into it finish first: a new layout may drop a buffer that a step's uploads still read."""
        if self._registered and self._buffer is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            _unregister(self._buffer)
        self._buffer, self._key, self._offsets, self._registered = None, None, [], False

    def __del__(self) -> None:
        # Unregistering before the memory can be freed: a freed range that stays registered would make a later
        # registration of the same pages fail.
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass


def _page_aligned(nbytes: int) -> torch.Tensor:
    """A buffer of whole pages that no other allocation shares, its storage starting on a page (an anonymous
    mapping): registration locks whole pages, two registered ranges on one page would refuse each other, and
    torch's `is_pinned` asks about the storage's first byte."""
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # (the tensor keeps the mapping alive)


def _status(result: object) -> int:
    """cudart calls return a cudaError enum (or a plain int, or a tuple starting with one)."""
    if isinstance(result, tuple):
        result = result[0]
    return int(getattr(result, "value", result))


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer` in place. A failure raises: torch's bindings cannot reset cudart's last error, which
    the next kernel launch's check would otherwise report as its own."""
    # cudaHostRegisterPortable (1): pinned for every device's context, as torch's own pinning helper asks
    error = _status(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {buffer.numel():,} bytes of host memory failed (cudaError "
                           f"{error}): the rollout engine's weights could not be page-locked for its sleep. Free "
                           "host memory, or set rollout.sleep=false to keep them on the GPU")
    return True


def _unregister(buffer: torch.Tensor) -> None:
    error = _status(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    if error != 0:
        log.warning("cudaHostUnregister failed (cudaError %d)", error)
