"""Clipped policy-gradient losses per token, registered by name (`actor.loss` chooses one).

Every loss takes (logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip) and returns
(token_loss [B, T], 0 off the action tokens; stats: detached clip_fraction, approx_kl, ratio_max,
ratio_min). Aggregation over tokens and sequences is aggregation.py's job.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from train.algorithms.masks import bool_mask, float_mask, masked_mean, masked_sum
from train.algorithms.ratios import LOG_RATIO_CLAMP, ratio_extremes
from train.algorithms.registry import Registry


class PolicyLoss(Protocol):
    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                 clip_high: float, dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "actor.loss")


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO per-token loss: -min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A), rho = exp(logp - old_logp).

    With dual_clip = c > 1 (Ye et al. 2020), tokens with A < 0 have their loss capped at -c*A.
    The log-ratio is clamped to [-20, 20] before exp(). token_loss is 0 on non-action tokens.
    stats (detached, over this batch's action tokens): clip_fraction (share of tokens where the
    clipped term is the active one, i.e. the gradient is cut), dual_clip_fraction, approx_kl
    (k3 = rho - 1 - log rho, an unbiased estimate of KL(old || new) under the sampled tokens),
    ratio_max / ratio_min (-inf / +inf when there are no action tokens).
    """
    m = bool_mask(mask)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    dual = torch.zeros_like(m)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    token_loss = torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))

    with torch.no_grad():
        rmax, rmin = ratio_extremes(ratio, m)
        stats = {
            "clip_fraction": masked_mean(clipped.to(logp.dtype), m),
            "dual_clip_fraction": masked_mean(dual.to(logp.dtype), m),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, m),
            "ratio_max": rmax,
            "ratio_min": rmin,
        }
    return token_loss, stats


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages_seq: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025) per-token loss: -min(s*A, clip(s, 1-clip_low, 1+clip_high)*A), s_i = exp(mean_t(logp - old_logp)).

    Each action token t of row i carries s_it = sg[s_i] * exp(logp_t - sg[logp_t]): its value is s_i
    and d s_it / d logp_t = s_i. With the "seq_mean_token_mean" aggregation, (1/|y_i|) sum_t of the
    token losses equals the paper's sequence loss -min(s_i A_i, clip(s_i) A_i) in value and in
    gradient (d s_i / d logp_t = s_i / |y_i|); clipping is decided per sequence. The mean log-ratio
    is clamped to [-20, 20] (it only enters detached). token_loss is 0 on non-action tokens.
    advantages_seq may also be [B, T] (the paper's GSPO-token variant, per-token advantages).
    dual_clip is PPO's per-token cap and is not used here (the loss has no per-token ratio).
    stats: clip_fraction (share of action tokens in clipped sequences), approx_kl (k3 of the
    token ratios, as in ppo_clip_loss), ratio_max / ratio_min over sequences with action tokens.
    """
    m = bool_mask(mask)
    fm = float_mask(mask, logp)
    log_ratio = logp - old_logp
    seq_log_ratio = masked_sum(log_ratio, m, dim=1) / fm.sum(dim=1).clamp_min(1.0)
    seq_ratio = torch.exp(seq_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # sg[s_i]
    s = seq_ratio[:, None] * torch.exp(logp - logp.detach())  # value s_i, gradient s_i per token
    A = advantages_seq[:, None] if advantages_seq.dim() == 1 else advantages_seq  # [B, T]: GSPO-token
    loss_unclipped = -A * s
    loss_clipped = -A * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    token_loss = torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))

    with torch.no_grad():
        clipped = loss_clipped > loss_unclipped
        has_tokens = m.any(dim=1)
        rmax, rmin = ratio_extremes(seq_ratio, has_tokens)
        lr = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        stats = {
            "clip_fraction": masked_mean(clipped.to(logp.dtype), m),
            "approx_kl": masked_mean(torch.exp(lr) - 1.0 - lr, m),
            "ratio_max": rmax,
            "ratio_min": rmin,
        }
    return token_loss, stats
