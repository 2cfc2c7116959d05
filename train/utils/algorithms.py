"""RL algorithm pieces: advantages, KL estimators, policy losses, loss aggregation.

Every function here is a pure tensor function: no distributed calls, no global state. Where a
quantity must be global (normalisers, advantage statistics), the caller computes it (e.g. with an
all-reduce) and passes it in.

Conventions
- Token-level tensors are [B, T] (padded). `mask` [B, T] (bool or float) is 1 on action tokens, the
  tokens the policy sampled, and 0 on prompt/template/tool/padding tokens.
- Sequence-level tensors are [B]. Samples of one prompt group are contiguous: B = n_groups * group_size.
- Token-level outputs are exactly 0 on non-action tokens.
- Statistics returned in `stats` dicts are detached 0-dim tensors (no host sync is forced here).
"""

import math

import torch
from torch import Tensor

# log-ratios are clamped to this range before exp() so that a wild token never makes inf/NaN
LOG_RATIO_CLAMP = 20.0


def _fmask(mask: Tensor, like: Tensor) -> Tensor:
    """The mask as a 0/1 float tensor of `like`'s dtype and device."""
    return mask.to(dtype=like.dtype, device=like.device)


def _bmask(mask: Tensor) -> Tensor:
    """The mask as a bool tensor."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) over `dim` (all dims if None); masked-out entries never leak NaN/inf."""
    v = torch.where(_bmask(mask), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return v.sum() if dim is None else v.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / max(1, sum(mask)) over `dim` (all dims if None)."""
    n = _fmask(mask, values).sum() if dim is None else _fmask(mask, values).sum(dim)
    return masked_sum(values, mask, dim) / n.clamp_min(1.0)


# ----------------------------------------------------------------------------------------------
# advantages


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """View rewards [B] as [n_groups, group_size]; contiguous samples form a group."""
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}")
    return rewards.view(-1, group_size)


def shared_baseline_advantages(rewards: Tensor, mean: float, std: float | None, eps: float = 1e-6) -> Tensor:
    """`adv.global_norm` for reinforce: one baseline for the whole batch, A_i = r_i - mean, divided
    by (std + eps) unless std is None (Dr. GRPO); mean and std are the batch's (all ranks), from
    `mean_var_from_sums` on all-reduced sums."""
    adv = rewards - mean
    return adv / (std + eps) if std is not None else adv


def shared_rloo_advantages(rewards: Tensor, total: float, count: float) -> Tensor:
    """`adv.global_norm` for rloo: leave-one-out over the whole batch, A_i = r_i - (total - r_i) /
    (count - 1), with total and count the batch's (all ranks); a batch of one -> 0."""
    if count <= 1:
        return torch.zeros_like(rewards)
    return rewards - (total - rewards) / (count - 1)


def mean_var_from_sums(n: float, s1: float, s2: float) -> tuple[float, float]:
    """(mean, Bessel-corrected variance) from a count, a sum and a sum of squares, e.g. all-reduced
    over ranks: var = (s2 - n * mean^2) / (n - 1); (0, 0) for n = 0 and variance 0 for n = 1."""
    if n <= 0:
        return 0.0, 0.0
    mean = s1 / n
    if n < 2:
        return mean, 0.0
    return mean, max((s2 - n * mean * mean) / (n - 1), 0.0)


def masked_sums(values: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """(count, sum, sum of squares) of values over the mask, as float64 Python numbers: the local
    part of global moments (all-reduce them, then `mean_var_from_sums`)."""
    sel = values[_bmask(mask)].double()
    return float(sel.numel()), float(sel.sum()), float((sel * sel).sum())


def group_sums(values: Tensor, groups: Tensor, n_groups: int) -> Tensor:
    """[n_groups, 3] float64 (count, sum, sum of squares) of `values` per group id: the local part of
    group statistics whose samples may sit on several ranks (all-reduce it, then use the functions
    below)."""
    v = values.double()
    out = torch.zeros(n_groups, 3, dtype=torch.float64)
    out.index_add_(0, groups.long(), torch.stack([torch.ones_like(v), v, v * v], dim=1))
    return out


def group_advantages_from_sums(values: Tensor, groups: Tensor, sums: Tensor, norm_var: bool,
                               eps: float = 1e-6) -> Tensor:
    """GRPO's A_i = r_i - mean_g, divided by (std_g + eps) if norm_var, with the group's count, sum
    and sum of squares `sums[g]` (all ranks): the Bessel-corrected std (G - 1), as verl, TRL and
    OpenRLHF; a group of one has advantage 0."""
    count, s1, s2 = sums[groups.long()].unbind(dim=1)
    mean = s1 / count.clamp_min(1.0)
    adv = values.double() - mean
    if norm_var:
        var = ((s2 - count * mean * mean) / (count - 1).clamp_min(1.0)).clamp_min(0.0)
        adv = torch.where(count > 1, adv / (var.sqrt() + eps), torch.zeros_like(adv))
    return adv


def group_rloo_from_sums(values: Tensor, groups: Tensor, sums: Tensor) -> Tensor:
    """RLOO's A_i = r_i - (sum_g - r_i) / (G - 1), from the group's count and sum (all ranks); a
    group of one has advantage 0."""
    count, s1, _ = sums[groups.long()].unbind(dim=1)
    v = values.double()
    return torch.where(count > 1, v - (s1 - v) / (count - 1).clamp_min(1.0), torch.zeros_like(v))


def global_normalize(adv: Tensor, mean: Tensor | float, std: Tensor | float, eps: float = 1e-6) -> Tensor:
    """(adv - mean) / (std + eps), with mean/std the global (all-rank) statistics given by the caller."""
    return (adv - mean) / (std + eps)


# ----------------------------------------------------------------------------------------------
# sequence <-> token placement


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """out[b, t] = seq_values[b] * mask[b, t]: the sequence value on every action token, 0 elsewhere."""
    zero = torch.zeros((), dtype=seq_values.dtype, device=seq_values.device)
    return torch.where(_bmask(mask), seq_values[:, None], zero)


def last_action_token_index(mask: Tensor) -> Tensor:
    """idx[b] = max{t : mask[b, t] = 1}; -1 for a row without action tokens."""
    m = _bmask(mask)
    T = m.shape[1]
    pos = torch.arange(T, device=m.device).expand_as(m)
    return torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=1)


def place_on_last_action_token(seq_values: Tensor, mask: Tensor) -> Tensor:
    """out[b, idx[b]] = seq_values[b] at the last action token, 0 elsewhere (rows without actions: all 0)."""
    idx = last_action_token_index(mask)
    B, T = mask.shape
    onehot = torch.arange(T, device=mask.device)[None, :] == idx[:, None]  # idx == -1 matches nothing
    zero = torch.zeros((), dtype=seq_values.dtype, device=seq_values.device)
    return torch.where(onehot, seq_values[:, None], zero)


# ----------------------------------------------------------------------------------------------
# GAE


@torch.no_grad()
def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE over action tokens only: delta_t = r_t + gamma*V_next - V_t, A_t = delta_t + gamma*lam*A_next.

    "next" is the next ACTION token of the same row (V_next = A_next = 0 after the last one), so
    prompt/tool tokens between turns are skipped, not discounted. Rewards and values on non-action
    tokens are ignored; advantages and returns (A_t + V_t) are 0 there. Computed without grad.
    """
    m = _bmask(mask)
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros(B, dtype=token_rewards.dtype, device=token_rewards.device)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        mt = m[:, t]
        adv[:, t] = torch.where(mt, a, torch.zeros_like(a))
        next_value = torch.where(mt, values[:, t], next_value)
        next_adv = torch.where(mt, a, next_adv)
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    returns = torch.where(m, adv + values, zero)
    return adv, returns


def whiten(values: Tensor, mask: Tensor, mean: float, var: float, eps: float = 1e-8) -> Tensor:
    """(v - mean) / sqrt(var + eps) on action tokens, 0 elsewhere; mean and var are the global
    (all-rank, Bessel-corrected) moments, e.g. `mean_var_from_sums` of all-reduced `masked_sums`."""
    out = (values - mean) * (1.0 / math.sqrt(var + eps))
    return torch.where(_bmask(mask), out, torch.zeros((), dtype=out.dtype, device=out.device))


# ----------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL divergence"), samples drawn from the policy


KL_TYPES = ("k1", "k2", "k3", "low_var_kl")  # the names the config takes
KL_KINDS = KL_TYPES + ("kl", "mse", "abs")  # with aliases


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) with d = logp - ref_logp: k1 = d, k2 = d^2/2, k3 = exp(-d) + d - 1.

    kinds: "k1" (alias "kl"), "k2" (alias "mse"), "k3", "abs" = |d|, and "low_var_kl" = k3 clamped to
    [-10, 10] (k3 >= 0, so in effect capped at 10; d is clamped to [-20, 20] first, which leaves the
    clamped value unchanged and keeps exp() finite). Gradients flow into both arguments.
    """
    d = logp - ref_logp
    if kind in ("k1", "kl"):
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d**2
    if kind == "abs":
        return d.abs()
    if kind == "k3":
        return torch.exp(-d) + d - 1.0
    if kind == "low_var_kl":
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


# ----------------------------------------------------------------------------------------------
# policy losses


def _ratio_stats(ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(max, min) of ratio over mask; -inf / +inf when the mask is empty (identities of a max/min reduce)."""
    m = _bmask(mask)
    r = ratio.detach()
    rmax = torch.where(m, r, torch.full_like(r, -math.inf)).amax()
    rmin = torch.where(m, r, torch.full_like(r, math.inf)).amin()
    return rmax, rmin


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
    m = _bmask(mask)
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
        rmax, rmin = _ratio_stats(ratio, m)
        stats = {
            "clip_fraction": masked_mean(clipped.to(logp.dtype), m),
            "dual_clip_fraction": masked_mean(dual.to(logp.dtype), m),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, m),
            "ratio_max": rmax,
            "ratio_min": rmin,
        }
    return token_loss, stats


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages_seq: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025) per-token loss: -min(s*A, clip(s, 1-clip_low, 1+clip_high)*A), s_i = exp(mean_t(logp - old_logp)).

    Each action token t of row i carries s_it = sg[s_i] * exp(logp_t - sg[logp_t]): its value is s_i
    and d s_it / d logp_t = s_i. With the "seq_mean_token_mean" aggregation, (1/|y_i|) sum_t of the
    token losses equals the paper's sequence loss -min(s_i A_i, clip(s_i) A_i) in value and in
    gradient (d s_i / d logp_t = s_i / |y_i|); clipping is decided per sequence. The mean log-ratio
    is clamped to [-20, 20] (it only enters detached). token_loss is 0 on non-action tokens.
    advantages_seq may also be [B, T] (the paper's GSPO-token variant, per-token advantages).
    stats: clip_fraction (share of action tokens in clipped sequences), approx_kl (k3 of the
    token ratios, as in ppo_clip_loss), ratio_max / ratio_min over sequences with action tokens.
    """
    m = _bmask(mask)
    fm = _fmask(mask, logp)
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
        rmax, rmin = _ratio_stats(seq_ratio, has_tokens)
        lr = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        stats = {
            "clip_fraction": masked_mean(clipped.to(logp.dtype), m),
            "approx_kl": masked_mean(torch.exp(lr) - 1.0 - lr, m),
            "ratio_max": rmax,
            "ratio_min": rmin,
        }
    return token_loss, stats


# ----------------------------------------------------------------------------------------------
# loss aggregation


AGG_MODES = ("all_token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum")
POLICY_LOSSES = ("ppo", "gspo")  # ppo_clip_loss (token ratio), gspo_loss (sequence ratio)
TIS_LEVELS = ("token", "sequence")  # tis_weights


def aggregate_loss(
    token_loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    n_tokens_global: float | Tensor,
    n_seqs_global: float | Tensor,
    max_len_norm: float | None = None,
) -> Tensor:
    """This micro-batch's share of the batch loss: sum over its rows / GLOBAL normaliser (see modes).

    - "all_token_mean":          sum_{i,t} m*l / n_tokens_global
    - "seq_mean_token_mean":     sum_i [sum_t m*l / max(1, n_i)] / n_seqs_global
    - "seq_mean_token_sum_norm": sum_i [sum_t m*l / max_len_norm] / n_seqs_global   (Dr. GRPO)
    - "seq_mean_token_sum":      sum_i sum_t m*l / n_seqs_global
    The normalisers count the whole mini-batch (all micro-batches, all data-parallel ranks), so the
    parts summed over micro-batches and ranks give the full-batch loss whatever the layout. A
    normaliser of 0 is treated as 1 (the numerator is then 0 as well).
    """
    per_seq = masked_sum(token_loss, mask, dim=1)
    if mode == "all_token_mean":
        return per_seq.sum() / _at_least_one(n_tokens_global)
    if mode == "seq_mean_token_mean":
        n = _fmask(mask, token_loss).sum(dim=1).clamp_min(1.0)
        return (per_seq / n).sum() / _at_least_one(n_seqs_global)
    if mode == "seq_mean_token_sum_norm":
        if max_len_norm is None or max_len_norm <= 0:
            raise ValueError("mode 'seq_mean_token_sum_norm' needs max_len_norm > 0 (e.g. the max response length)")
        return (per_seq / max_len_norm).sum() / _at_least_one(n_seqs_global)
    if mode == "seq_mean_token_sum":
        return per_seq.sum() / _at_least_one(n_seqs_global)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")


def _at_least_one(n: float | Tensor) -> float | Tensor:
    """max(n, 1) for a python number or a tensor."""
    return n.clamp_min(1.0) if isinstance(n, Tensor) else max(float(n), 1.0)


# ----------------------------------------------------------------------------------------------
# logits -> entropy / log-probs


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v * z_v over the last dim ([B, T, V] -> [B, T]); -inf logits allowed."""
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    z = torch.where(p > 0, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))  # 0 * -inf -> 0
    return lse - (p * z).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(z / temperature)[label] = z_label / temperature - logsumexp(z / temperature) ([B, T, V] -> [B, T]).

    Gathers the label logit and takes a logsumexp instead of materialising a full log_softmax.
    `labels` must be valid vocabulary ids everywhere (mask the result, not the labels).
    """
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# ----------------------------------------------------------------------------------------------
# sampler / trainer mismatch


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
    m = _bmask(mask)
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
        rmax, _ = _ratio_stats(ratio, mask)
        return {"kl": masked_sum(ratio - 1.0 - d, mask), "abs_diff": masked_sum(d.abs(), mask), "max_ratio": rmax}


# ----------------------------------------------------------------------------------------------
# reward shaping


def overlong_penalty(response_lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment: 0 if L <= Lmax - buffer, -penalty*(L - (Lmax - buffer))/buffer up to Lmax, -penalty beyond.

    At L = Lmax the penalty is the full -penalty; with buffer = 0 only L > Lmax is penalised.
    Integer lengths give a tensor of the default float dtype.
    """
    if not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer must be in [0, max_new_tokens={max_new_tokens}], got {buffer}")
    L = response_lengths
    if not L.is_floating_point():
        L = L.to(torch.get_default_dtype())
    start = max_new_tokens - buffer
    if buffer == 0:
        frac = (L > max_new_tokens).to(L.dtype)
    else:
        frac = ((L - start) / buffer).clamp(0.0, 1.0)
    return 0.0 - penalty * frac  # (not -penalty * frac: no -0.0)


# ----------------------------------------------------------------------------------------------
# token-level rewards and returns (PPO / REINFORCE++)


def token_level_rewards(outcome: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """r_t = -kl_coef * kl_t on every action token, plus the outcome reward on the last action token.

    `outcome` [B]; `kl` [B, T] (a per-token KL estimate, e.g. k1) or None. 0 on non-action tokens.
    """
    out = place_on_last_action_token(outcome, mask)
    if kl is not None and kl_coef:
        out = out - kl_coef * torch.where(_bmask(mask), kl.to(out.dtype), torch.zeros((), dtype=out.dtype,
                                                                                        device=out.device))
    return out


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k>=0} gamma^k r_{t_k} over the action tokens t = t_0 < t_1 < ... of the row (REINFORCE++);
    non-action tokens are skipped, not discounted, and hold 0. Equal to GAE with V = 0 and lambda = 1."""
    values = torch.zeros_like(token_rewards)
    return gae(token_rewards, values, mask, gamma, 1.0)[0]


# ----------------------------------------------------------------------------------------------
# critic


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -c, c).

    With clip None it is 0.5 * (V - R)^2. 0 on non-action tokens. stats (detached, over action
    tokens): clip_fraction (share of tokens where the clipped term is the larger, i.e. the gradient
    is cut), values / returns means.
    """
    m = _bmask(mask)
    unclipped = (values - returns) ** 2
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped, clipped)
        cut = clipped > unclipped
    else:
        loss = 0.5 * unclipped
        cut = torch.zeros_like(m)
    token_loss = torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean(cut.to(values.dtype), m),
            "values": masked_mean(values.detach(), m),
            "returns": masked_mean(returns, m),
        }
    return token_loss, stats


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


# ----------------------------------------------------------------------------------------------
# schedules


ENTROPY_SCHEDULES = ("constant", "linear", "cosine")


def entropy_coef_schedule(step: int, total_steps: int, coef: float, min_coef: float, kind: str) -> float:
    """Entropy bonus coefficient at optimizer step `step` (0-based) of `total_steps`: `coef` decayed
    to the floor `min_coef` (linear or cosine), never below the floor; "constant" is `coef`."""
    if kind == "constant":
        return coef
    progress = min(1.0, max(0.0, step / max(1, total_steps)))
    if kind == "linear":
        value = coef + (min_coef - coef) * progress
    elif kind == "cosine":
        value = min_coef + (coef - min_coef) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown entropy schedule {kind!r}; valid: {', '.join(ENTROPY_SCHEDULES)}")
    return max(value, min_coef)


# ----------------------------------------------------------------------------------------------
# DAPO dynamic sampling


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[n_groups] bool: True where the group's rewards are not all equal (it carries a learning signal)."""
    r = _groups(rewards, group_size)
    return (r != r[:, :1]).any(dim=1)


def split_quota(counts: list[int], target: int) -> list[int]:
    """How many of its `counts[r]` items each rank keeps so that `min(target, sum)` are kept in all,
    as evenly as the counts allow (max-min fair: every rank keeps min(count, L) or L + 1, the extra
    ones going to the lowest ranks). Deterministic: every rank computes the same answer from the same
    all-reduced counts."""
    total = min(target, sum(counts))
    level = 0  # the largest L with sum(min(c, L)) <= total
    while sum(min(c, level + 1) for c in counts) <= total and level < max(counts, default=0):
        level += 1
    keep = [min(c, level) for c in counts]
    left = total - sum(keep)
    for r, c in enumerate(counts):
        if left and c > level:
            keep[r] += 1
            left -= 1
    return keep
