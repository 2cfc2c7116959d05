"""Probability ratios shared by the policy losses and the sampler diagnostics."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from train.algorithms.masks import bool_mask

# log-ratios are clamped to this range before exp() so that a wild token never makes inf/NaN
LOG_RATIO_CLAMP = 20.0


def ratio_extremes(ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(max, min) of ratio over mask; -inf / +inf when the mask is empty (identities of a max/min reduce)."""
    m = bool_mask(mask)
    r = ratio.detach()
    rmax = torch.where(m, r, torch.full_like(r, -math.inf)).amax()
    rmin = torch.where(m, r, torch.full_like(r, math.inf)).amin()
    return rmax, rmin
