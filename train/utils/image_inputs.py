"""One processed image as the trainer carries it from rollout to the update (train/datasets/vision.py
makes them; train/parallel/step_batch.py sends them to the ranks that train their sample)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """One processed image: the tower's input patches [patches, channels x t x patch x patch] (float32),
    its patch grid (t, h, w), its placeholder token count, and a digest of its pixels (two images with
    the same digest give the same tokens: packing may lay them out once)."""
    pixel_values: torch.Tensor
    grid: torch.Tensor  # int64 [3]
    tokens: int
    digest: str = field(default="")

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


def digest_of(pixels: torch.Tensor) -> str:
    """A digest of an image's patches: equal for equal pixels, on every rank."""
    return hashlib.blake2b(pixels.contiguous().numpy().tobytes(), digest_size=12).hexdigest()


