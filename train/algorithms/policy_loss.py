"""Policy-gradient losses per token, registered by name (`actor.loss` chooses one).

Every loss takes (logp, old_logp, advantages, mask, settings: LossSettings) and returns (token_loss
[B, T], 0 off the action tokens; stats: detached clip_fraction, approx_kl, ratio_max, ratio_min).
Aggregation over tokens and sequences is aggregation.py's job.

The family: ppo (token-ratio clip, dual clip), gspo (sequence ratio), cispo (clipped, detached IS
weight), gmpo (geometric mean), gpg (no ratio), dppo_tv / dppo_kl (a trust region on the token's
probability, not its ratio), sapo (a soft, sigmoid-gated trust region), dro (a quadratic log-ratio
penalty), clip_cov / kl_cov (PPO that holds back the tokens whose advantage and log-prob covary most).
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import Tensor

from train.algorithms.masks import bool_mask, float_mask, masked_mean, masked_sum
from train.algorithms.ratios import LOG_RATIO_CLAMP, ratio_extremes
from train.algorithms.registry import Registry


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """What a loss reads besides the tensors, resolved once from `actor.*` (train/models/actor.py
    `loss_settings`; the defaults live in config/grpo.yaml). A setting that only some losses read is
    None when unset, and the loss that needs it says which key to set."""
    clip_low: float  # ppo/gspo/cispo/gmpo/clip_cov: the ratio (or log-ratio) floor's distance; dppo: the threshold
    clip_high: float  # ... the ceiling's distance; dppo: the threshold for A > 0
    dual_clip: float | None = None  # ppo: cap on negative-advantage losses (actor.dual_clip)
    ratio_cap: float | None = None  # dppo: ceiling of the detached IS weight (actor.dppo_ratio_cap)
    tau_pos: float | None = None  # sapo: gate temperature for A > 0 (actor.sapo_tau_pos)
    tau_neg: float | None = None  # sapo: ... for A <= 0 (actor.sapo_tau_neg)
    dro_beta: float | None = None  # dro: weight of the quadratic log-ratio penalty (actor.dro_beta)
    cov_ratio: float | None = None  # clip_cov/kl_cov: share of a micro-batch's tokens held back (actor.cov_ratio)
    cov_low: float | None = None  # clip_cov: candidates have covariance in (cov_low, cov_high) (actor.cov_low)
    cov_high: float | None = None  # (actor.cov_high)
    kl_cov_coef: float | None = None  # kl_cov: weight of |log ratio| on the held-back tokens (actor.kl_cov_coef)

    def need(self, name: str, loss: str) -> float:
        """The setting `name`, or a ValueError naming its config key when a loss that reads it finds it unset."""
        value = getattr(self, name)
        if value is None:
            key = {"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg", "ratio_cap": "dppo_ratio_cap"}.get(name, name)
            raise ValueError(f"actor.loss={loss} needs actor.{key} (unset)")
        return float(value)


class PolicyLoss(Protocol):
    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                 settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]: ...


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


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, settings: LossSettings) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic loss max(-r*A, -clip(r, 1 - clip_low, 1 + clip_high)*A) and where the clipped
    term is the active one (the token's gradient is cut there)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
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
    loss, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, settings)
    dual = torch.zeros_like(m)
    dual_clip = settings.dual_clip
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return _on_actions(loss, m), _stats(clipped, log_ratio.detach(), m,
                                        dual_clip_fraction=masked_mean(dual.to(logp.dtype), m).detach())


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp: Tensor, old_logp: Tensor, advantages_seq: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
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
    loss_clipped = -A * s.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).detach()
    lr = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _on_actions(loss, m), _stats(clipped, lr, m, ratios=seq_ratio, over=m.any(dim=1))


@POLICY_LOSSES.register("cispo")
def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
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
    weight = ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)  # detached: no gradient through the weight
    loss = -weight * advantages * logp
    return _on_actions(loss, m), _stats(weight != ratio, log_ratio, m)


@POLICY_LOSSES.register("gmpo")
def gmpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
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
    kept = sign * torch.minimum(sign * d, sign * d.clamp(-settings.clip_low, settings.clip_high))
    seq_log = masked_sum(kept, m, dim=1) / n
    seq_adv = masked_sum(A, m, dim=1) / n
    s = torch.exp(seq_log.detach())
    token = -seq_adv[:, None] * s[:, None] * torch.exp(kept - kept.detach())
    return _on_actions(token, m), _stats(kept.detach().ne(d.detach()), d.detach(), m, ratios=s, over=m.any(dim=1))


POLICY_LOSSES.add("geo_mean", gmpo_loss, listed=False)  # verl's name for it


@POLICY_LOSSES.register("gpg")
def gpg_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025, "Group Policy Gradient") per-token loss: -A * logp, the plain policy gradient
    with group-relative advantages and no ratio, no clip (clip_low/high and dual_clip do not apply): every
    pass treats the samples as on-policy. stats: approx_kl and the ratio extremes, for the logs."""
    m = bool_mask(mask)
    loss = -advantages * logp
    d = (logp.detach() - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _on_actions(loss, m), _stats(torch.zeros_like(m), d, m)


def _dppo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, settings: LossSettings,
               inside: Tensor, name: str) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's shared form: -A * sg(min(rho, ratio_cap)) * logp on the tokens `inside` the trust region, 0 on
    the others (their gradient is cut). The gradient on a kept token is -min(rho, cap) * A * d logp = -A * d rho
    below the cap: PPO's unclipped gradient; the cap is truncated IS instead of a dual clip."""
    m = bool_mask(mask)
    cap = settings.need("ratio_cap", name)
    log_ratio = (logp.detach() - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weight = torch.exp(log_ratio).clamp(max=cap)
    return _on_actions(-advantages * weight * logp, m & inside), _stats(~inside, log_ratio, m)


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (2026, arXiv 2602.04879): the trust region is on the sampled token's probability,
    not its ratio: a token is kept while p - p_old <= clip_high (A > 0) or p - p_old >= -clip_low (A <= 0),
    p = exp(logp). A ratio clip over-restricts rare tokens (a tiny p can double and still barely move) and
    under-restricts likely ones; a bound on the probability change is the total-variation distance of the
    binary (token / not token) distribution. Kept tokens: -A * sg(min(rho, ratio_cap)) * logp.
    stats: clip_fraction (tokens outside the region: no gradient), approx_kl, ratio extremes."""
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    inside = torch.where(advantages > 0, p - p_old <= settings.clip_high, p - p_old >= -settings.clip_low)
    return _dppo_loss(logp, old_logp, advantages, mask, settings, inside, "dppo_tv")


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL: as dppo_tv with the binary KL of (p_old, 1 - p_old) to (p, 1 - p) as the divergence,
    p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)) (the 1e-8 as the authors'
    code, for p = 1); a token is cut when the divergence exceeds clip_high (A > 0, p rising) or clip_low
    (A <= 0, p falling): only the move the advantage pushes for is bounded."""
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    kl = p_old * (old_logp - logp) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    inside = torch.where(advantages > 0, (kl <= settings.clip_high) | (p <= p_old),
                         (kl <= settings.clip_low) | (p >= p_old))
    return _dppo_loss(logp, old_logp, advantages, mask, settings, inside, "dppo_kl")


@POLICY_LOSSES.register("sapo")
def sapo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Qwen, 2025, arXiv 2511.20347, "Soft Adaptive Policy Optimization") per-token loss: -f(rho) * A,
    f(rho) = (4 / tau) * sigmoid(tau * (rho - 1)), tau = tau_pos where A > 0, else tau_neg.

    A soft trust region instead of a hard clip: f'(1) = 1 (the plain policy gradient on policy) and
    f'(rho) = 4 sigmoid (1 - sigmoid) fades smoothly as rho leaves 1, so a token past the bound keeps a small
    gradient instead of none; tau_neg > tau_pos fades negative-advantage tokens faster (their large ratios
    are the unstable ones). The paper aggregates per sequence (actor.agg_mode=seq_mean_token_mean, the
    preset). The log-ratio is clamped to [-20, 20]. stats: clip_fraction 0 (nothing is cut), approx_kl,
    ratio extremes."""
    m = bool_mask(mask)
    tau_pos, tau_neg = settings.need("tau_pos", "sapo"), settings.need("tau_neg", "sapo")
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    tau = torch.where(advantages > 0, logp.new_tensor(tau_pos), logp.new_tensor(tau_neg))  # logp's precision
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    return _on_actions(-gate * advantages, m), _stats(torch.zeros_like(m), log_ratio.detach(), m)


@POLICY_LOSSES.register("dro")
def dro_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO (Richemond et al. 2024, "Direct Reward Optimisation") per-token loss:
    -(A * logp - beta/2 * (logp - old_logp)^2): the policy gradient with a quadratic penalty that pulls the
    log-prob back to the sampling policy's instead of a clip (beta = actor.dro_beta). With one pass per
    rollout the penalty and its gradient are 0 and this is gpg. stats: clip_fraction 0, approx_kl, ratio
    extremes."""
    m = bool_mask(mask)
    beta = settings.need("dro_beta", "dro")
    d = logp - old_logp
    loss = -(advantages * logp - 0.5 * beta * d.square())
    lr = d.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _on_actions(loss, m), _stats(torch.zeros_like(m), lr, m)


def _covariance(advantages: Tensor, logp: Tensor, m: Tensor) -> Tensor:
    """Each action token's centred (A - mean A) * (logp - mean logp) over this micro-batch's action tokens
    (detached): the tokens whose probability rises with their advantage, which drive entropy collapse
    (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models")."""
    lp = logp.detach()
    return (advantages - masked_mean(advantages, m)) * (lp - masked_mean(lp, m))


def _content_generator(old_logp: Tensor, m: Tensor) -> torch.Generator:
    """A generator seeded from the micro-batch's own numbers: every rank that holds the same micro-batch (tp and
    sp ranks of one dp group) draws the same tokens, a rerun draws them again, and the run's random streams
    (checkpointed for resume) are left untouched."""
    bits = torch.where(m, old_logp.detach(), torch.zeros((), dtype=old_logp.dtype, device=old_logp.device))
    seed = int(bits.double().view(torch.int64).sum().item()) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator().manual_seed(seed)


@POLICY_LOSSES.register("clip_cov")
def clip_cov_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025): PPO's clipped loss, and besides the clip, a random cov_ratio share of the
    micro-batch's action tokens (at least one) drawn from those with covariance in (cov_low, cov_high) and not
    already clipped gets no gradient: the few high-covariance tokens that would collapse the entropy are
    held back. The draw is seeded from the micro-batch (see _content_generator), not the global stream.
    stats: clip_fraction (tokens whose gradient is cut, by the clip or the draw), approx_kl, ratio extremes."""
    m = bool_mask(mask)
    ratio_share, low, high = (settings.need(k, "clip_cov") for k in ("cov_ratio", "cov_low", "cov_high"))
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, settings)
    cov = _covariance(advantages, logp, m)
    candidates = (m & ~clipped & (cov > low) & (cov < high)).nonzero()
    limit = max(int(ratio_share * int(m.sum())), 1)
    if len(candidates) > limit:
        pick = torch.randperm(len(candidates), generator=_content_generator(old_logp, m))[:limit]
        candidates = candidates[pick.to(candidates.device)]
    held = torch.zeros_like(m)
    held[candidates[:, 0], candidates[:, 1]] = True
    return _on_actions(loss, m & ~held), _stats(clipped | held, log_ratio.detach(), m)


@POLICY_LOSSES.register("kl_cov")
def kl_cov_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025): the unclipped surrogate -rho * A, plus kl_cov_coef * |logp - old_logp| on the
    cov_ratio share of the micro-batch's action tokens (at least one) with the largest covariance: instead of
    a clip, a KL penalty holds back exactly the tokens that would collapse the entropy.
    stats: clip_fraction (the penalised share), approx_kl, ratio extremes."""
    m = bool_mask(mask)
    ratio_share, coef = settings.need("cov_ratio", "kl_cov"), settings.need("kl_cov_coef", "kl_cov")
    d = logp - old_logp
    log_ratio = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss = -advantages * torch.exp(log_ratio)
    held = torch.zeros_like(m)
    n = int(m.sum())
    if n:
        cov = _covariance(advantages, logp, m)
        top = torch.where(m, cov, torch.full_like(cov, -torch.inf)).flatten().topk(max(int(n * ratio_share), 1))
        held.view(-1)[top.indices] = True
    loss = torch.where(held, loss + coef * d.abs(), loss)
    return _on_actions(loss, m), _stats(held, log_ratio.detach(), m)
