"""Counts, sums and sums of squares (the parts of a statistic that add up over ranks) and the
statistics built from them. The caller all-reduces the sums; nothing here communicates."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from train.algorithms.masks import bool_mask


def masked_sums(values: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """(count, sum, sum of squares) of values over the mask, as float64 Python numbers: the local
    part of global moments (all-reduce them, then `mean_var_from_sums`)."""
    sel = values[bool_mask(mask)].double()
    return float(sel.numel()), float(sel.sum()), float((sel * sel).sum())


def mean_var_from_sums(n: float, s1: float, s2: float) -> tuple[float, float]:
    """(mean, Bessel-corrected variance) from a count, a sum and a sum of squares, e.g. all-reduced
    over ranks: var = (s2 - n * mean^2) / (n - 1); (0, 0) for n = 0 and variance 0 for n = 1."""
    if n <= 0:
        return 0.0, 0.0
    mean = s1 / n
    if n < 2:
        return mean, 0.0
    return mean, max((s2 - n * mean * mean) / (n - 1), 0.0)


def group_sums(values: Tensor, groups: Tensor, n_groups: int) -> Tensor:
    """[n_groups, 3] float64 (count, sum, sum of squares) of `values` per group id: the local part of
    group statistics whose samples may sit on several ranks (all-reduce it, then pass it to an
    estimator)."""
    v = values.double()
    out = torch.zeros(n_groups, 3, dtype=torch.float64)
    out.index_add_(0, groups.long(), torch.stack([torch.ones_like(v), v, v * v], dim=1))
    return out


def global_normalize(adv: Tensor, mean: Tensor | float, std: Tensor | float, eps: float = 1e-6) -> Tensor:
    """(adv - mean) / (std + eps), with mean/std the global (all-rank) statistics given by the caller."""
    return (adv - mean) / (std + eps)


def whiten(values: Tensor, mask: Tensor, mean: float, var: float, eps: float = 1e-8) -> Tensor:
    """(v - mean) / sqrt(var + eps) on action tokens, 0 elsewhere; mean and var are the global
    (all-rank, Bessel-corrected) moments, e.g. `mean_var_from_sums` of all-reduced `masked_sums`."""
    out = (values - mean) * (1.0 / math.sqrt(var + eps))
    return torch.where(bool_mask(mask), out, torch.zeros((), dtype=out.dtype, device=out.device))


def explained_variance_from_moments(n: float, sum_r: float, sumsq_r: float, sum_e: float, sumsq_e: float) -> float:
    """1 - Var(e) / Var(R), e = R - V, from (all-reduced) counts and sums; nan if Var(R) == 0 or n == 0."""
    if n <= 0:
        return math.nan
    var_r = sumsq_r / n - (sum_r / n) ** 2
    var_e = sumsq_e / n - (sum_e / n) ** 2
    if var_r <= 0:
        return math.nan
    return 1.0 - var_e / var_r


def merge_moments(count: float, mean: float, var: float, batch_count: float, batch_mean: float,
                  batch_var: float) -> tuple[float, float, float]:
    """Running (count, mean, population var) merged with a batch's (Chan et al.'s parallel update):
    the result equals the moments of the concatenated data."""
    total = count + batch_count
    if total <= 0:
        return 0.0, 0.0, 0.0
    delta = batch_mean - mean
    new_mean = mean + delta * batch_count / total
    m2 = var * count + batch_var * batch_count + delta * delta * count * batch_count / total
    return total, new_mean, m2 / total
