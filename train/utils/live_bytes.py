"""The bytes of tensors that ops allocate and still hold, and their peak: a device-free stand-in for the CUDA
allocator's `max_memory_allocated` (less its block rounding), for checking memory rules on CPU.

    with LiveBytes() as held:
        loss.backward()
    held.peak  # the most bytes the backward's own tensors held at once
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Counts each storage an op under it allocates until the storage is freed (`live`), and the most at once
    (`peak`). A view or an in-place op returns its input's storage, which is not counted; nor are tensors made
    before the mode was entered."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in given and key not in self._seen:
                self._seen.add(key)
                self.live += storage.nbytes()
                # torch keeps a storage's Python object as long as the storage lives: this runs when it is freed
                weakref.finalize(storage, self._freed, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out
