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


def _on_actions(loss: Tensor, m: Tensor) -> Tensor:
    """`loss` on the action tokens, exactly 0 elsewhere (no NaN/inf from padding leaks into a sum)."""
    return torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def _stats(clipped: Tensor, log_ratio: Tensor, m: Tensor, ratios: Tensor | None = None, over: Tensor | None = None,
           **extra: Tensor) -> dict[str, Tensor]:
    """The stats every loss reports, detached, over the action tokens `m`: clip_fraction (share where
    `clipped`), approx_kl (k3 = r - 1 - log r of the clamped token log-ratios: an unbiased estimate of
    KL(old || new) under the sampled tokens), ratio_max / ratio_min of `ratios` over `over` (default: the
    token ratios over the action tokens; -inf / +inf when empty)."""
    with torch.no_grad():
        token_ratio = torch.exp(log_ratio)
        rmax, rmin = ratio_extremes(token_ratio if ratios is None else ratios, m if over is None else over)
        return {"clip_fraction": masked_mean(clipped.to(log_ratio.dtype), m), **extra,
                "approx_kl": masked_mean(token_ratio - 1.0 - log_ratio, m), "ratio_max": rmax, "ratio_min": rmin}


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float,
                  dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
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
    return _on_actions(loss, m), _stats(clipped, log_ratio.detach(), m,
                                        dual_clip_fraction=masked_mean(dual.to(logp.dtype), m).detach())


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp: Tensor, old_logp: Tensor, advantages_seq: Tensor, mask: Tensor, clip_low: float, clip_high: float,
              dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
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
    clipped = (loss_clipped > loss_unclipped).detach()
    lr = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _on_actions(loss, m), _stats(clipped, lr, m, ratios=seq_ratio, over=m.any(dim=1))


@POLICY_LOSSES.register("cispo")
def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float,
               dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025) per-token loss: -sg(clip(rho, 1-clip_low, 1+clip_high)) * A * logp.

    The importance weight is clipped and detached instead of the update: every action token keeps the
    gradient -w*A * d logp (PPO gives a token whose clipped term is active no gradient at all, so
    rare "fork" tokens whose ratio moves fast stop learning). The value is the paper's (and verl's)
    objective -w*A*logp, so it is not comparable with ppo's loss value; the gradients agree with
    PPO's when rho is inside the range. clip_low = 1 puts no floor on the weight (the paper).
    The log-ratio is clamped to [-20, 20] before exp(). dual_clip does not apply (no min of two terms).
    stats: clip_fraction (share of action tokens whose weight was clipped: their gradient is scaled
    by the bound, not cut), approx_kl (k3, as ppo_clip_loss), ratio_max / ratio_min.
    """
    m = bool_mask(mask)
    log_ratio = (logp.detach() - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # detached: no gradient through the weight
    loss = -weight * advantages * logp
    return _on_actions(loss, m), _stats(weight != ratio, log_ratio, m)


@POLICY_LOSSES.register("gmpo")
def gmpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float,
              dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization") per-token loss: the sequence loss
    -A_i * exp(mean_t m_t), m_t = sgn(A) * min(sgn(A) d_t, sgn(A) clip(d_t, -clip_low, clip_high)),
    d_t = logp_t - old_logp_t: PPO's pessimistic clip applied to each token's log-ratio (bounds in log
    space: the paper's (-0.4, 0.4) is clip_low = clip_high = 0.4), then a geometric mean instead of
    GSPO's. A_i is the row's mean advantage over its action tokens (GRPO's one value per sequence).

    Each action token carries -A_i * sg[s_i] * exp(m_t - sg[m_t]) (s_i = exp(mean_t m_t)): its value is the
    sequence loss, and with "seq_mean_token_mean" the loss and its gradient are the paper's mean over
    sequences (as GSPO's implementation). dual_clip does not apply. stats: clip_fraction (action tokens
    whose log-ratio was clipped in the direction that cuts the gradient), approx_kl (k3 of the token
    ratios), ratio_max / ratio_min over the sequences' s_i."""
    m = bool_mask(mask)
    fm = float_mask(mask, logp)
    A = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
    n = fm.sum(dim=1).clamp_min(1.0)
    sign = torch.sign(A)
    d = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kept = sign * torch.minimum(sign * d, sign * d.clamp(-clip_low, clip_high))
    seq_log = masked_sum(kept, m, dim=1) / n
    seq_adv = masked_sum(A, m, dim=1) / n
    s = torch.exp(seq_log.detach())
    token = -seq_adv[:, None] * s[:, None] * torch.exp(kept - kept.detach())
    return _on_actions(token, m), _stats(kept.detach().ne(d.detach()), d.detach(), m, ratios=s, over=m.any(dim=1))


POLICY_LOSSES.add("geo_mean", gmpo_loss, listed=False)  # verl's name for it


@POLICY_LOSSES.register("gpg")
def gpg_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float,
             dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025, "Group Policy Gradient") per-token loss: -A * logp, the plain policy gradient
    with group-relative advantages and no ratio, no clip (clip_low/high and dual_clip do not apply): every
    pass treats the samples as on-policy. stats: approx_kl and the ratio extremes, for the logs."""
    m = bool_mask(mask)
    loss = -advantages * logp
    d = (logp.detach() - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _on_actions(loss, m), _stats(torch.zeros_like(m), d, m)
