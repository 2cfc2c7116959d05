"""Sampler vs trainer: truncated importance-sampling weights and mismatch diagnostics."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from train.algorithms.masks import bool_mask, masked_sum
from train.algorithms.ratios import LOG_RATIO_CLAMP, ratio_extremes

TIS_LEVELS = ("token", "sequence")  # tis_weights


def tis_weights(
    old_logp_trainer: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float, level: str = "token"
) -> Tensor:
    """Truncated IS weights w = min(pi_trainer / pi_sampler, cap): per token, or per sequence (product over action tokens).

    "token": w_t = min(exp(old_logp_trainer_t - sampler_logp_t), cap);
    "sequence": w_i = min(exp(sum_t m*(old_logp_trainer - sampler_logp)), cap) broadcast to the row.
    Computed in log space (no overflow); detached; 0 on non-action tokens.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    log_cap = math.log(cap)
    log_ratio = (old_logp_trainer - sampler_logp).detach()
    m = bool_mask(mask)
    if level == "token":
        w = torch.exp(log_ratio.clamp(max=log_cap))
    elif level == "sequence":
        w = torch.exp(masked_sum(log_ratio, m, dim=1).clamp(max=log_cap))[:, None].expand_as(log_ratio)
    else:
        raise ValueError(f"unknown TIS level {level!r}; valid levels: token, sequence")
    return torch.where(m, w, torch.zeros((), dtype=w.dtype, device=w.device))


def sampler_mismatch_sums(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sampler-vs-trainer diagnostics over action tokens, d = trainer_logp - sampler_logp, as sums to
    be reduced over ranks and divided by the global action-token count: "kl" sums k3 = exp(d) - 1 - d,
    an unbiased, non-negative estimate of KL(sampler || trainer) (the tokens were drawn by the
    sampler); "abs_diff" sums |d|; "max_ratio" is max exp(d) (-inf with no action tokens). Detached
    0-dim tensors."""
    with torch.no_grad():
        d = (trainer_logp - sampler_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(d)
        rmax, _ = ratio_extremes(ratio, mask)
        return {"kl": masked_sum(ratio - 1.0 - d, mask), "abs_diff": masked_sum(d.abs(), mask), "max_ratio": rmax}


MIS_LEVELS = ("token", "sequence")  # mis_keep


def mis_keep(old_logp_trainer: Tensor, sampler_logp: Tensor, mask: Tensor, low: float, high: float,
             level: str = "token") -> Tensor:
    """Masked importance sampling (IcePop-style): 1 where the trainer/sampler probability ratio lies in
    [low, high], 0 where it leaves it, so those tokens contribute no gradient at all (TIS would only
    cap their weight).

    "token": r_t = exp(old_logp_trainer_t - sampler_logp_t), each token kept or masked on its own;
    "sequence": the geometric mean r_i = exp(mean_t(old_logp_trainer - sampler_logp)) over the row's
    action tokens decides for the whole row. Detached; 0 on non-action tokens; a float tensor that
    multiplies the token loss (and composes with the TIS weights)."""
    if not 0 < low < 1 < high:
        raise ValueError(f"masked IS bounds must satisfy 0 < low < 1 < high, got [{low}, {high}]")
    m = bool_mask(mask)
    d = (old_logp_trainer - sampler_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if level == "token":
        r = torch.exp(d)
    elif level == "sequence":
        n = m.sum(dim=1).clamp_min(1)
        r = torch.exp(masked_sum(d, m, dim=1) / n)[:, None].expand_as(d)
    else:
        raise ValueError(f"unknown masked IS level {level!r}; valid levels: {', '.join(MIS_LEVELS)}")
    keep = m & (r >= low) & (r <= high)
    return keep.to(d.dtype)
