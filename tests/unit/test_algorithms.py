"""train/algorithms/ (pure tensor functions) against independent float64 numpy references written from the
formulas.

Every reference below is plain numpy (loops over rows / action-token lists), not a port of the
torch code. Values must agree to 1e-6; gradients of the losses w.r.t. logp (torch.autograd) are
compared to central finite differences of the numpy references.
"""

import math

import numpy as np
import pytest
import torch

from train.algorithms.advantages import (group_advantages_from_sums, group_rloo_from_sums, shared_baseline_advantages,
                                         shared_rloo_advantages)
from train.algorithms.aggregation import AGG_MODES, aggregate_loss
from train.algorithms.dynamic_sampling import informative_groups, split_quota
from train.algorithms.kl import kl_estimate
from train.algorithms.logits import entropy_from_logits, logprobs_from_logits
from train.algorithms.masks import broadcast_to_tokens, last_action_token_index, place_on_last_action_token
from train.algorithms.mismatch import mis_keep, sampler_mismatch_sums, tis_weights
from train.algorithms.moments import (explained_variance_from_moments, global_normalize, group_sums, masked_sums,
                                      mean_var_from_sums, merge_moments, whiten)
from train.algorithms.policy_loss import (LossSettings, clip_cov_loss, cispo_loss, dppo_kl_loss, dppo_tv_loss, dro_loss,
                                          gmpo_loss, gpg_loss, gspo_loss, kl_cov_loss, ppo_clip_loss, sapo_loss)
from train.algorithms.returns import discounted_returns, gae, token_level_rewards
from train.algorithms.schedules import entropy_coef_schedule
from train.algorithms.shaping import overlong_penalty
from train.algorithms.value_loss import value_loss

TOL = 1e-6


# ----------------------------------------------------------------------------------------------
# helpers


def ragged_mask(rng: np.random.Generator, B: int, T: int, empty_row: bool = False) -> np.ndarray:
    """Rows: a prompt prefix (0), then action spans (1) interleaved with tool spans (0), then padding (0)."""
    mask = np.zeros((B, T))
    for b in range(B):
        t = int(rng.integers(1, T // 4))  # prompt
        end = int(rng.integers(t + 1, T + 1))  # padding from here
        while t < end:
            n_act = int(rng.integers(1, 8))
            mask[b, t : min(t + n_act, end)] = 1
            t += n_act + int(rng.integers(1, 5))  # a tool / user span between turns
    if empty_row:
        mask[rng.integers(B)] = 0
    return mask


def t64(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x), dtype=torch.float64)


def tmask(mask: np.ndarray) -> torch.Tensor:
    return torch.tensor(mask > 0)


def close(a, b, tol: float = TOL) -> None:
    a, b = (x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64) for x in (a, b))
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def num_grad(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central finite differences of the scalar function f at x, one element at a time."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (f(xp) - f(xm)) / (2 * h)
    return g


def action_positions(mask_row: np.ndarray) -> list[int]:
    return [t for t in range(len(mask_row)) if mask_row[t] > 0]


# ----------------------------------------------------------------------------------------------
# advantages


def ref_group_baseline(r: np.ndarray, G: int, norm_var: bool, eps: float) -> np.ndarray:
    out = np.zeros_like(r)
    for g0 in range(0, len(r), G):
        grp = r[g0 : g0 + G]
        mu = sum(grp) / G
        # Bessel-corrected (G - 1), as verl / TRL / OpenRLHF; a group of one has advantage 0
        sd = math.sqrt(sum((x - mu) ** 2 for x in grp) / (G - 1)) if G > 1 else 0.0
        for k in range(G):
            out[g0 + k] = (grp[k] - mu) / (sd + eps) if norm_var else grp[k] - mu
    return out


def ref_rloo(r: np.ndarray, G: int) -> np.ndarray:
    out = np.zeros_like(r)
    for g0 in range(0, len(r), G):
        for i in range(G):
            others = [r[g0 + j] for j in range(G) if j != i]
            out[g0 + i] = r[g0 + i] - (sum(others) / len(others) if others else r[g0 + i])
    return out


def split_sums(r: np.ndarray, groups: np.ndarray, n_groups: int, cuts: tuple[int, ...]) -> torch.Tensor:
    """group_sums over parts of the batch (as dp groups hold them), added: what the all-reduce gives."""
    bounds = (0, *cuts, len(r))
    return sum(group_sums(t64(r[a:b]), torch.tensor(groups[a:b]), n_groups) for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("G", [1, 2, 5])
@pytest.mark.parametrize("norm_var", [False, True])
def test_group_advantages_from_sums(G, norm_var):
    """GRPO's group baseline from per-group sums, the samples of a group split over several parts
    (dp groups) and their sums added, against the float64 reference on contiguous groups."""
    rng = np.random.default_rng(G)
    r = rng.normal(size=4 * G)
    r[:G] = 0.7  # a constant group: advantage 0, not NaN
    if G > 1:
        r[G : 2 * G] = rng.integers(0, 2, size=G)  # binary rewards
    groups = np.repeat(np.arange(4), G)
    perm = rng.permutation(4 * G)  # samples in any order across the parts
    sums = split_sums(r[perm], groups[perm], 4, (G, 3 * G - 1))
    got = group_advantages_from_sums(t64(r[perm]), torch.tensor(groups[perm]), sums, norm_var)
    assert got.dtype == torch.float64 and got.shape == (4 * G,)
    close(got, ref_group_baseline(r, G, norm_var, 1e-6)[perm])
    assert torch.isfinite(got).all()
    const = [i for i, g in enumerate(groups[perm]) if g == 0]
    assert got[const].abs().max() < 1e-9  # the constant group (float rounding of its mean aside)


@pytest.mark.parametrize("G", [1, 2, 4])
def test_group_rloo_from_sums(G):
    rng = np.random.default_rng(10 + G)
    r = rng.normal(size=3 * G)
    groups = np.repeat(np.arange(3), G)
    perm = rng.permutation(3 * G)
    sums = split_sums(r[perm], groups[perm], 3, (1,))
    got = group_rloo_from_sums(t64(r[perm]), torch.tensor(groups[perm]), sums)
    close(got, ref_rloo(r, G)[perm])
    if G == 1:
        assert torch.equal(got, torch.zeros(3, dtype=torch.float64))


def test_moments_from_sums_match_numpy():
    rng = np.random.default_rng(11)
    x = rng.normal(size=37) * 4 + 2
    n, s1, s2 = masked_sums(t64(x), torch.ones(37, dtype=torch.bool))
    assert n == 37
    mean, var = mean_var_from_sums(n, s1, s2)
    assert mean == pytest.approx(np.mean(x), rel=1e-12) and var == pytest.approx(np.var(x, ddof=1), rel=1e-10)
    # sums split over "ranks" and added give the same moments
    parts = [masked_sums(t64(x[a:b]), torch.ones(b - a, dtype=torch.bool)) for a, b in ((0, 10), (10, 37))]
    merged = mean_var_from_sums(*[sum(p[k] for p in parts) for k in range(3)])
    assert merged == pytest.approx((mean, var), rel=1e-12)
    assert mean_var_from_sums(0, 0.0, 0.0) == (0.0, 0.0) and mean_var_from_sums(1, 3.0, 9.0) == (3.0, 0.0)


def test_shared_baselines_against_float64_references():
    rng = np.random.default_rng(12)
    r = rng.normal(size=10)
    mu, sd = float(np.mean(r)), float(np.std(r, ddof=1))
    close(shared_baseline_advantages(t64(r), mu, sd), (r - mu) / (sd + 1e-6))
    close(shared_baseline_advantages(t64(r), mu, None), r - mu)
    ref = np.array([r[i] - (r.sum() - r[i]) / (len(r) - 1) for i in range(len(r))])
    close(shared_rloo_advantages(t64(r), float(r.sum()), float(len(r))), ref)
    close(shared_rloo_advantages(t64(r[:1]), float(r[0]), 1.0), np.zeros(1))


def test_global_normalize():
    adv = np.random.default_rng(3).normal(size=8)
    close(global_normalize(t64(adv), 0.3, 2.0, eps=1e-6), (adv - 0.3) / (2.0 + 1e-6))
    close(global_normalize(t64(adv), t64(0.3), t64(2.0)), (adv - 0.3) / (2.0 + 1e-6))


# ----------------------------------------------------------------------------------------------
# placement


def test_broadcast_and_last_token_placement():
    rng = np.random.default_rng(4)
    B, T = 7, 25
    mask = ragged_mask(rng, B, T, empty_row=True)
    vals = rng.normal(size=B)
    ref_b = np.zeros((B, T))
    ref_last = np.zeros((B, T))
    ref_idx = np.full(B, -1)
    for b in range(B):
        pos = action_positions(mask[b])
        for t in pos:
            ref_b[b, t] = vals[b]
        if pos:
            ref_idx[b] = pos[-1]
            ref_last[b, pos[-1]] = vals[b]
    for m in (tmask(mask), t64(mask)):
        close(broadcast_to_tokens(t64(vals), m), ref_b)
        idx = last_action_token_index(m)
        assert idx.dtype == torch.long and idx.tolist() == ref_idx.tolist()
        close(place_on_last_action_token(t64(vals), m), ref_last)


# ----------------------------------------------------------------------------------------------
# GAE / whiten


def ref_gae(r, v, mask, gamma, lam):
    B, T = r.shape
    adv, ret = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        pos = action_positions(mask[b])
        last = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            v_next = v[b, pos[k + 1]] if k + 1 < len(pos) else 0.0
            delta = r[b, t] + gamma * v_next - v[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
            ret[b, t] = last + v[b, t]
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae(gamma, lam):
    rng = np.random.default_rng(5)
    B, T = 6, 40
    mask = ragged_mask(rng, B, T, empty_row=True)
    r = rng.normal(size=(B, T)) * mask  # e.g. k1 KL penalties on every action token
    v = rng.normal(size=(B, T))
    v[mask == 0] = 123.0  # values on non-action tokens must be ignored
    adv, ret = gae(t64(r), t64(v), tmask(mask), gamma, lam)
    ref_adv, ref_ret = ref_gae(r, v, mask, gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_outcome_reward_gamma_one():
    # gamma = lam = 1, reward on the last action token: A_t = R - V_t on every action token
    rng = np.random.default_rng(6)
    B, T = 5, 30
    mask = ragged_mask(rng, B, T)
    R = rng.normal(size=B)
    v = rng.normal(size=(B, T))
    tr = place_on_last_action_token(t64(R), tmask(mask))
    adv, ret = gae(tr, t64(v), tmask(mask), 1.0, 1.0)
    close(adv, (R[:, None] - v) * mask)
    close(ret, R[:, None] * mask)


def test_whiten():
    """Whitening with global moments: the masked sums of two "ranks" added give the batch's."""
    rng = np.random.default_rng(7)
    mask = ragged_mask(rng, 5, 30)
    v = rng.normal(size=(5, 30)) * 2 + 0.5
    sel = v[mask > 0]
    mu, var = np.mean(sel), np.var(sel, ddof=1)
    parts = [masked_sums(t64(v[:2]), tmask(mask[:2])), masked_sums(t64(v[2:]), tmask(mask[2:]))]
    mean, variance = mean_var_from_sums(*[sum(p[k] for p in parts) for k in range(3)])
    assert mean == pytest.approx(mu) and variance == pytest.approx(var)
    close(whiten(t64(v), tmask(mask), mean, variance), (v - mu) / np.sqrt(var + 1e-8) * mask)


# ----------------------------------------------------------------------------------------------
# KL


def ref_kl(lp, rlp, kind):
    d = lp - rlp
    if kind in ("k1", "kl"):
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    if kind == "abs":
        return np.abs(d)
    k3 = np.exp(rlp - lp) - (rlp - lp) - 1.0
    return k3 if kind == "k3" else np.minimum(np.maximum(k3, -10.0), 10.0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl", "kl", "mse", "abs"])
def test_kl_estimate_values_and_grads(kind):
    rng = np.random.default_rng(8)
    B, T = 4, 12
    lp = -np.abs(rng.normal(size=(B, T))) * 2
    rlp = -np.abs(rng.normal(size=(B, T))) * 2
    if kind == "low_var_kl":
        lp[0, :3] = [-15.0, -0.1, -3.0]  # k3 > 10 here: clamped, zero gradient
        rlp[0, :3] = [-0.1, -15.0, -3.0]
    W = rng.normal(size=(B, T))
    x = t64(lp).requires_grad_(True)
    out = kl_estimate(x, t64(rlp), kind)
    close(out, ref_kl(lp, rlp, kind))
    (out * t64(W)).sum().backward()
    close(x.grad, num_grad(lambda z: np.sum(ref_kl(z, rlp, kind) * W), lp), 1e-6)


def test_kl_low_var_extreme_is_finite():
    lp = torch.tensor([[-200.0, 0.0, -1e4]], dtype=torch.float32, requires_grad=True)
    rlp = torch.tensor([[0.0, -200.0, 0.0]], dtype=torch.float32)
    out = kl_estimate(lp, rlp, "low_var_kl")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(lp.grad).all() and out.max() <= 10
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_estimate(lp, rlp, "k4")


# ----------------------------------------------------------------------------------------------
# PPO


def ref_ppo_token(lp, olp, A, cl, ch, dual):
    ratio = np.exp(lp - olp)
    surr = np.minimum(ratio * A, np.clip(ratio, 1 - cl, 1 + ch) * A)  # the objective, maximised
    loss = -surr
    if dual is not None:
        loss = np.where(A < 0, np.minimum(loss, -dual * A), loss)
    return loss


def ppo_inputs(seed, B=6, T=30):
    rng = np.random.default_rng(seed)
    mask = ragged_mask(rng, B, T, empty_row=True)
    olp = -np.abs(rng.normal(size=(B, T)))
    lp = olp + rng.normal(size=(B, T)) * 0.6  # ratios from ~0.2 to ~5: clip and dual clip both hit
    A = rng.normal(size=(B, T)) * 2
    b = int(np.argmax(mask.sum(1)))
    t = action_positions(mask[b])[:3]
    lp[b, t], A[b, t] = olp[b, t] + 1.5, -1.0  # ratio 4.5 with A < 0: the dual clip surely bites
    return rng, mask, lp, olp, A


@pytest.mark.parametrize("dual", [None, 1.5, 3.0])
@pytest.mark.parametrize("cl,ch", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_loss(dual, cl, ch):
    rng, mask, lp, olp, A = ppo_inputs(9)
    W = rng.uniform(0.5, 1.5, size=lp.shape)
    x = t64(lp).requires_grad_(True)
    loss, stats = ppo_clip_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(cl, ch, dual_clip=dual))

    ref = ref_ppo_token(lp, olp, A, cl, ch, dual) * mask
    close(loss, ref)
    (loss * t64(W)).sum().backward()
    g_ref = num_grad(lambda z: np.sum(ref_ppo_token(z, olp, A, cl, ch, dual) * mask * W), lp)
    close(x.grad, g_ref)
    assert (x.grad[torch.tensor(mask == 0)] == 0).all()

    # stats: independent definitions over action tokens
    sel = mask > 0
    ratio = np.exp(lp - olp)[sel]
    a = A[sel]
    clipped = np.array([(r > 1 + ch and aa > 0) or (r < 1 - cl and aa < 0) for r, aa in zip(ratio, a)])
    close(stats["clip_fraction"], clipped.mean())
    close(stats["approx_kl"], np.mean(ratio - 1 - np.log(ratio)))
    close(stats["ratio_max"], ratio.max())
    close(stats["ratio_min"], ratio.min())
    if dual is not None:
        dual_hit = (a < 0) & (-a * ratio > -dual * a)
        close(stats["dual_clip_fraction"], dual_hit.mean())
        assert dual_hit.any()
    assert clipped.any()
    for v in stats.values():
        assert not v.requires_grad


def test_ppo_identity_ratio_and_empty_mask():
    rng, mask, lp, olp, A = ppo_inputs(11)
    x = t64(olp).requires_grad_(True)  # on-policy: ratio 1, loss -A, gradient -A
    loss, stats = ppo_clip_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(0.2, 0.2))
    close(loss, -A * mask)
    loss.sum().backward()
    close(x.grad, -A * mask)
    close(stats["clip_fraction"], 0.0), close(stats["approx_kl"], 0.0)
    empty = torch.zeros(mask.shape, dtype=torch.bool)
    loss, stats = ppo_clip_loss(t64(lp), t64(olp), t64(A), empty, LossSettings(0.2, 0.2, dual_clip=3.0))
    assert (loss == 0).all() and stats["clip_fraction"] == 0 and stats["ratio_max"] == -math.inf
    with pytest.raises(ValueError):
        ppo_clip_loss(t64(lp), t64(olp), t64(A), empty, LossSettings(0.2, 0.2, dual_clip=0.5))


# ----------------------------------------------------------------------------------------------
# GSPO


def ref_gspo_objective(lp, olp, A_seq, mask, cl, ch):
    """The paper's loss: mean over sequences of -min(s_i A_i, clip(s_i, 1-cl, 1+ch) A_i)."""
    total = 0.0
    for b in range(lp.shape[0]):
        pos = action_positions(mask[b])
        if not pos:
            continue
        s = math.exp(sum(lp[b, t] - olp[b, t] for t in pos) / len(pos))
        total += -min(s * A_seq[b], min(max(s, 1 - cl), 1 + ch) * A_seq[b])
    return total / lp.shape[0]


def sequence_loss_inputs(seed, B=8, T=30):
    """Ragged multi-turn rows (one empty), log-ratios of spread 0.3 and one advantage per sequence."""
    rng = np.random.default_rng(seed)
    mask = ragged_mask(rng, B, T, empty_row=True)
    olp = -np.abs(rng.normal(size=(B, T)))
    lp = olp + rng.normal(size=(B, T)) * 0.3
    return mask, lp, olp, rng.normal(size=B), t64(lp).requires_grad_(True)


@pytest.mark.parametrize("cl,ch", [(0.2, 0.3), (3e-4, 4e-4)])
def test_gspo_loss(cl, ch):
    B, T = 8, 30
    mask, lp, olp, A, x = sequence_loss_inputs(12, B, T)
    token_loss, stats = gspo_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(cl, ch))

    # value on each action token = the sequence loss
    seq_ratio = np.zeros(B)
    for b in range(B):
        pos = action_positions(mask[b])
        s = math.exp(np.mean([lp[b, t] - olp[b, t] for t in pos])) if pos else 1.0
        seq_ratio[b] = s
        seq_loss = -min(s * A[b], min(max(s, 1 - cl), 1 + ch) * A[b])
        close(token_loss[b], seq_loss * mask[b])

    # seq_mean_token_mean aggregation == the paper's objective, value and gradient
    J = aggregate_loss(token_loss, tmask(mask), "seq_mean_token_mean", n_tokens_global=mask.sum(), n_seqs_global=B)
    close(J, ref_gspo_objective(lp, olp, A, mask, cl, ch))
    J.backward()
    g_ref = num_grad(lambda z: ref_gspo_objective(z, olp, A, mask, cl, ch), lp)
    close(x.grad, g_ref)

    has = mask.sum(1) > 0
    close(stats["ratio_max"], seq_ratio[has].max()), close(stats["ratio_min"], seq_ratio[has].min())
    seq_clipped = np.array([(s > 1 + ch and a > 0) or (s < 1 - cl and a < 0) for s, a in zip(seq_ratio, A)])
    close(stats["clip_fraction"], np.sum(seq_clipped * mask.sum(1)) / mask.sum())
    if cl < 1e-3:
        assert seq_clipped.any()


# ----------------------------------------------------------------------------------------------
# CISPO


def ref_cispo_token(lp, olp, A, cl, ch):
    """MiniMax-M1's per-token loss, -w A log pi with w = clip(pi / pi_old, 1 - cl, 1 + ch) held fixed."""
    w = np.clip(np.exp(lp - olp), 1 - cl, 1 + ch)
    return -w * A * lp, w


@pytest.mark.parametrize("cl,ch", [(1.0, 5.0), (0.2, 0.28)])
def test_cispo_loss(cl, ch):
    rng, mask, lp, olp, A = ppo_inputs(21)
    b = int(np.argmax(mask.sum(1)))
    lp[b, action_positions(mask[b])[-2:]] += 2.5  # ratios above 1 + 5: the default ceiling bites too
    W = rng.uniform(0.5, 1.5, size=lp.shape)
    x = t64(lp).requires_grad_(True)
    loss, stats = cispo_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(cl, ch))
    ref, w = ref_cispo_token(lp, olp, A, cl, ch)
    close(loss, ref * mask)
    (loss * t64(W)).sum().backward()
    # the weight is a constant to the gradient: d/d lp of -w A lp is -w A, on every action token
    close(x.grad, -w * A * mask * W)
    sel = mask > 0
    ratio = np.exp(lp - olp)[sel]
    clipped = (ratio < 1 - cl) | (ratio > 1 + ch)
    close(stats["clip_fraction"], clipped.mean())
    close(stats["approx_kl"], np.mean(ratio - 1 - np.log(ratio)))
    close(stats["ratio_max"], ratio.max()), close(stats["ratio_min"], ratio.min())
    assert clipped.any()
    # where PPO's clip cuts a token's gradient to 0, CISPO keeps it (the point of the method)
    y = t64(lp).requires_grad_(True)
    ppo_clip_loss(y, t64(olp), t64(A), tmask(mask), LossSettings(cl if cl < 1 else 0.2, ch))[0].sum().backward()
    cut = sel & (y.grad.numpy() == 0) & (A != 0)
    assert cut.any() and (x.grad.numpy()[cut] != 0).all()


def test_cispo_gradient_is_ppos_on_policy():
    """At ratio 1 (one pass over a rollout) both losses have the gradient -A per action token."""
    rng, mask, lp, olp, A = ppo_inputs(22)
    x, y = t64(olp).requires_grad_(True), t64(olp).requires_grad_(True)
    cispo_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(1.0, 5.0))[0].sum().backward()
    ppo_clip_loss(y, t64(olp), t64(A), tmask(mask), LossSettings(0.2, 0.2))[0].sum().backward()
    close(x.grad, y.grad), close(x.grad, -A * mask)


# ----------------------------------------------------------------------------------------------
# GMPO, GPG


def ref_gmpo_objective(lp, olp, A_seq, mask, cl, ch):
    """The paper's loss: mean over sequences of -A_i * exp(mean_t of the token log-ratio clipped pessimistically
    in log space to [-cl, ch])."""
    total = 0.0
    for b in range(lp.shape[0]):
        pos = action_positions(mask[b])
        if not pos:
            continue
        kept = []
        for t in pos:
            d = lp[b, t] - olp[b, t]
            clipped = min(max(d, -cl), ch)
            kept.append(min(d, clipped) if A_seq[b] > 0 else max(d, clipped) if A_seq[b] < 0 else d)
        total += -A_seq[b] * math.exp(sum(kept) / len(kept))
    return total / lp.shape[0]


@pytest.mark.parametrize("clip", [0.4, 0.05])
def test_gmpo_loss(clip):
    B, T = 8, 30
    mask, lp, olp, A, x = sequence_loss_inputs(23, B, T)
    token_loss, stats = gmpo_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(clip, clip))
    J = aggregate_loss(token_loss, tmask(mask), "seq_mean_token_mean", n_tokens_global=mask.sum(), n_seqs_global=B)
    close(J, ref_gmpo_objective(lp, olp, A, mask, clip, clip))
    J.backward()
    close(x.grad, num_grad(lambda z: ref_gmpo_objective(z, olp, A, mask, clip, clip), lp))
    d = (lp - olp)[mask > 0]
    a = np.repeat(A[:, None], T, axis=1)[mask > 0]
    cut = ((a > 0) & (d > clip)) | ((a < 0) & (d < -clip))
    close(stats["clip_fraction"], cut.mean())
    assert cut.any()


def test_gpg_loss_is_the_plain_policy_gradient():
    rng, mask, lp, olp, A = ppo_inputs(24)
    x = t64(lp).requires_grad_(True)
    loss, stats = gpg_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(0.2, 0.2))
    close(loss, -A * lp * mask)
    loss.sum().backward()
    close(x.grad, -A * mask)  # every token, whatever its ratio: no clip
    close(stats["clip_fraction"], 0.0)


# ----------------------------------------------------------------------------------------------
# SAPO, DRO, DPPO (TV / KL), Clip-Cov, KL-Cov


def ref_sapo_token(lp, olp, A, tau_pos, tau_neg):
    """Soft gate f(r) = 4/tau * sigmoid(tau (r - 1)), tau by the sign of A; loss -f(r) A."""
    r = np.exp(lp - olp)
    tau = np.where(A > 0, tau_pos, tau_neg)
    return -(4.0 / tau) / (1.0 + np.exp(-tau * (r - 1.0))) * A


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_loss(tau_pos, tau_neg):
    rng, mask, lp, olp, A = ppo_inputs(31)
    W = rng.uniform(0.5, 1.5, size=lp.shape)
    x = t64(lp).requires_grad_(True)
    settings = LossSettings(0.2, 0.2, tau_pos=tau_pos, tau_neg=tau_neg)
    loss, stats = sapo_loss(x, t64(olp), t64(A), tmask(mask), settings)
    ref = ref_sapo_token(lp, olp, A, tau_pos, tau_neg) * mask
    close(loss, ref)
    (loss * t64(W)).sum().backward()
    close(x.grad, num_grad(lambda z: np.sum(ref_sapo_token(z, olp, A, tau_pos, tau_neg) * mask * W), lp))
    close(stats["clip_fraction"], 0.0)
    # on policy the gate's slope is 1: the plain policy gradient -A
    y = t64(olp).requires_grad_(True)
    sapo_loss(y, t64(olp), t64(A), tmask(mask), settings)[0].sum().backward()
    close(y.grad, -A * mask)
    # far off policy a token keeps a small gradient where PPO's clip cuts it to 0
    far = (mask > 0) & (np.abs(lp - olp) > 0.5)
    assert far.any() and (np.abs(x.grad.numpy()[far]) > 0).all()


def test_sapo_needs_its_temperatures():
    rng, mask, lp, olp, A = ppo_inputs(31)
    with pytest.raises(ValueError, match="actor.sapo_tau_pos"):
        sapo_loss(t64(lp), t64(olp), t64(A), tmask(mask), LossSettings(0.2, 0.2))


@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_dro_loss(beta):
    rng, mask, lp, olp, A = ppo_inputs(32)
    x = t64(lp).requires_grad_(True)
    loss, stats = dro_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(0.2, 0.2, dro_beta=beta))
    ref = lambda z: -(A * z - 0.5 * beta * (z - olp) ** 2) * mask  # noqa: E731
    close(loss, ref(lp))
    loss.sum().backward()
    close(x.grad, num_grad(lambda z: np.sum(ref(z)), lp))
    with pytest.raises(ValueError, match="actor.dro_beta"):
        dro_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(0.2, 0.2))


def probability_inputs(seed, B=6, T=30):
    """As ppo_inputs, with log-probs <= 0 (DPPO reads the probabilities themselves) and some tokens whose
    probability moves by more than 0.3 either way."""
    rng, mask, lp, olp, A = ppo_inputs(seed, B, T)
    olp = np.log(rng.uniform(0.02, 0.98, size=lp.shape))
    lp = np.log(np.clip(np.exp(olp) + rng.normal(size=lp.shape) * 0.2, 1e-3, 1.0 - 1e-3))
    return rng, mask, lp, olp, A


def ref_dppo_inside(lp, olp, A, low, high, kind):
    """Per token, from the paper's definitions: is the move the advantage pushes for within the region?"""
    out = np.zeros(lp.shape, dtype=bool)
    for idx in np.ndindex(lp.shape):
        p, q, a = math.exp(lp[idx]), math.exp(olp[idx]), A[idx]
        if kind == "tv":
            out[idx] = (p - q <= high) if a > 0 else (p - q >= -low)
        else:
            kl = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            out[idx] = (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)
    return out


@pytest.mark.parametrize("kind,low,high,cap", [("tv", 0.2, 0.2, 20.0), ("tv", 0.05, 0.1, 1.5),
                                              ("kl", 0.05, 0.05, 20.0), ("kl", 0.01, 0.03, 1.5)])
def test_dppo_losses(kind, low, high, cap):
    rng, mask, lp, olp, A = probability_inputs(33)
    fn = dppo_tv_loss if kind == "tv" else dppo_kl_loss
    x = t64(lp).requires_grad_(True)
    loss, stats = fn(x, t64(olp), t64(A), tmask(mask), LossSettings(low, high, ratio_cap=cap))
    inside = ref_dppo_inside(lp, olp, A, low, high, kind)
    w = np.minimum(np.exp(lp - olp), cap)
    close(loss, -A * w * lp * inside * mask)
    loss.sum().backward()
    close(x.grad, -A * w * inside * mask)  # the weight is held fixed: PPO's unclipped gradient -A d(rho)
    sel = mask > 0
    close(stats["clip_fraction"], (~inside)[sel].mean())
    assert (~inside)[sel].any() and inside[sel].any()
    if cap < 2:
        assert (np.exp(lp - olp)[sel & inside] > cap).any()  # the cap bites on a kept token


def ref_covariance(lp, A, mask):
    sel = mask > 0
    return (A - A[sel].mean()) * (lp - lp[sel].mean())


@pytest.mark.parametrize("share", [0.05, 0.9])
def test_clip_cov_loss(share):
    rng, mask, lp, olp, A = ppo_inputs(34)
    settings = LossSettings(0.2, 0.2, cov_ratio=share, cov_low=0.05, cov_high=5.0)
    x = t64(lp).requires_grad_(True)
    loss, stats = clip_cov_loss(x, t64(olp), t64(A), tmask(mask), settings)
    ppo = ref_ppo_token(lp, olp, A, 0.2, 0.2, None) * mask
    ratio = np.exp(lp - olp)
    clipped = (mask > 0) & (-A * np.clip(ratio, 0.8, 1.2) > -A * ratio)
    cov = ref_covariance(lp, A, mask)
    candidates = (mask > 0) & ~clipped & (cov > 0.05) & (cov < 5.0)
    limit = max(int(share * mask.sum()), 1)
    loss.sum().backward()
    held = (mask > 0) & (loss.detach().numpy() == 0) & (ppo != 0)
    assert held.sum() == min(limit, candidates.sum()) and (held <= candidates).all()
    close(loss, ppo * ~held)
    assert (x.grad.numpy()[held] == 0).all()
    close(stats["clip_fraction"], (clipped | held)[mask > 0].mean())
    # the draw depends on the micro-batch only: a rerun holds back the same tokens
    again, _ = clip_cov_loss(t64(lp), t64(olp), t64(A), tmask(mask), settings)
    assert torch.equal(again, loss.detach())


@pytest.mark.parametrize("share,coef", [(0.05, 1.0), (0.3, 0.1)])
def test_kl_cov_loss(share, coef):
    rng, mask, lp, olp, A = ppo_inputs(35)
    sel = mask > 0
    cov = ref_covariance(lp, A, mask)
    k = max(int(sel.sum() * share), 1)
    threshold = np.sort(cov[sel])[-k]
    held = sel & (cov >= threshold)

    def ref(z):
        return (-A * np.exp(z - olp) + coef * np.abs(z - olp) * held) * mask

    x = t64(lp).requires_grad_(True)
    loss, stats = kl_cov_loss(x, t64(olp), t64(A), tmask(mask), LossSettings(0.2, 0.2, cov_ratio=share,
                                                                              kl_cov_coef=coef))
    close(loss, ref(lp))
    loss.sum().backward()
    close(x.grad, num_grad(lambda z: np.sum(ref(z)), lp))
    close(stats["clip_fraction"], held[sel].mean())


# ----------------------------------------------------------------------------------------------
# aggregation


def ref_aggregate(l, mask, mode, n_tok, n_seq, max_len):
    total = 0.0
    for b in range(l.shape[0]):
        pos = action_positions(mask[b])
        s = sum(l[b, t] for t in pos)
        if mode == "all_token_mean":
            total += s / n_tok
        elif mode == "seq_mean_token_mean":
            total += s / max(1, len(pos)) / n_seq
        elif mode == "seq_mean_token_sum_norm":
            total += s / max_len / n_seq
        else:
            total += s / n_seq
    return total


@pytest.mark.parametrize("mode", AGG_MODES.names())
def test_aggregate_loss_values_and_grads(mode):
    rng = np.random.default_rng(13)
    B, T = 6, 30
    mask = ragged_mask(rng, B, T, empty_row=True)
    l = rng.normal(size=(B, T))
    l[mask == 0] = np.nan  # off-mask garbage must not leak
    kw = dict(n_tokens_global=float(mask.sum()), n_seqs_global=float(B), max_len_norm=float(T))
    x = t64(l).requires_grad_(True)
    out = aggregate_loss(x, tmask(mask), mode, **kw)
    close(out, ref_aggregate(l, mask, mode, kw["n_tokens_global"], B, T))
    out.backward()
    l0 = np.where(mask > 0, l, 0.0)
    close(x.grad, num_grad(lambda z: ref_aggregate(z, mask, mode, kw["n_tokens_global"], B, T), l0))
    # tensor normalisers (e.g. after an all-reduce) work the same
    out_t = aggregate_loss(t64(l), t64(mask), mode, n_tokens_global=t64(mask.sum()), n_seqs_global=t64(B), max_len_norm=T)
    close(out_t, out)


@pytest.mark.parametrize("mode", AGG_MODES.names())
def test_aggregate_loss_layout_independent(mode):
    """Micro-batches and fake data-parallel ranks (slices), summed, equal the whole batch to 1e-12."""
    rng = np.random.default_rng(14)
    B, T = 12, 40
    mask = tmask(ragged_mask(rng, B, T, empty_row=True))
    l = t64(rng.normal(size=(B, T)))
    kw = dict(n_tokens_global=float(mask.sum()), n_seqs_global=float(B), max_len_norm=float(T))
    whole = aggregate_loss(l, mask, mode, **kw).item()
    layouts = [
        [range(0, 12)],
        [range(0, 6), range(6, 12)],  # 2 ranks, 1 micro-batch each
        [range(0, 3), range(3, 6), range(6, 9), range(9, 12)],  # 2 ranks x 2 micro-batches
        [range(0, 5), range(5, 6), range(6, 11), range(11, 12)],  # uneven micro-batches
        [range(i, i + 1) for i in range(12)],  # one row per micro-batch
    ]
    for parts in layouts:
        total = sum(aggregate_loss(l[list(p)], mask[list(p)], mode, **kw).item() for p in parts)
        assert abs(total - whole) < 1e-12, (parts, total, whole)
    # the same rows shuffled over ranks give the same sum too
    perm = rng.permutation(B)
    total = sum(aggregate_loss(l[perm[i::2]], mask[perm[i::2]], mode, **kw).item() for i in range(2))
    assert abs(total - whole) < 1e-12


def test_aggregate_loss_errors():
    l, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError) as e:
        aggregate_loss(l, m, "token_mean", n_tokens_global=6, n_seqs_global=2)
    for mode in AGG_MODES.names():
        assert mode in str(e.value)
    with pytest.raises(ValueError, match="max_len_norm"):
        aggregate_loss(l, m, "seq_mean_token_sum_norm", n_tokens_global=6, n_seqs_global=2)
    assert aggregate_loss(l, torch.zeros(2, 3), "all_token_mean", n_tokens_global=0, n_seqs_global=0) == 0


# ----------------------------------------------------------------------------------------------
# logits


def ref_log_softmax(z):
    zmax = np.max(z, axis=-1, keepdims=True)
    return z - zmax - np.log(np.sum(np.exp(z - zmax), axis=-1, keepdims=True))


def ref_entropy(z):
    lsm = ref_log_softmax(z)
    return -np.sum(np.exp(lsm) * lsm, axis=-1)


def test_entropy_from_logits():
    rng = np.random.default_rng(15)
    z = rng.normal(size=(2, 3, 7)) * 3
    z[0, 0] += 500.0  # stability: huge logits
    W = rng.normal(size=(2, 3))
    x = t64(z).requires_grad_(True)
    H = entropy_from_logits(x)
    close(H, ref_entropy(z))
    (H * t64(W)).sum().backward()
    close(x.grad, num_grad(lambda q: np.sum(ref_entropy(q) * W), z))
    # -inf logits (masked vocabulary) neither give NaN nor change the entropy of the rest
    zi = z.copy()
    zi[..., -2:] = -np.inf
    xi = t64(zi).requires_grad_(True)
    Hi = entropy_from_logits(xi)
    close(Hi, ref_entropy(z[..., :-2]))
    Hi.sum().backward()
    assert torch.isfinite(xi.grad).all()
    assert entropy_from_logits(torch.randn(2, 3, 5, dtype=torch.float32)).dtype == torch.float32


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_logprobs_from_logits(temperature):
    rng = np.random.default_rng(16)
    B, T, V = 2, 4, 9
    z = rng.normal(size=(B, T, V)) * 2
    labels = rng.integers(0, V, size=(B, T))
    W = rng.normal(size=(B, T))

    def ref(q):
        lsm = ref_log_softmax(q / temperature)
        return np.take_along_axis(lsm, labels[..., None], axis=-1)[..., 0]

    x = t64(z).requires_grad_(True)
    lp = logprobs_from_logits(x, torch.tensor(labels), temperature=temperature)
    close(lp, ref(z))
    (lp * t64(W)).sum().backward()
    close(x.grad, num_grad(lambda q: np.sum(ref(q) * W), z))


# ----------------------------------------------------------------------------------------------
# sampler / trainer mismatch


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [2.0, 1.0, math.inf])
def test_tis_weights(level, cap):
    rng = np.random.default_rng(17)
    B, T = 6, 25
    mask = ragged_mask(rng, B, T, empty_row=True)
    samp = -np.abs(rng.normal(size=(B, T)))
    train = samp + rng.normal(size=(B, T)) * 0.2
    ref = np.zeros((B, T))
    for b in range(B):
        pos = action_positions(mask[b])
        seq_w = min(float(np.prod([np.exp(train[b, t] - samp[b, t]) for t in pos])), cap)
        for t in pos:
            ref[b, t] = min(math.exp(train[b, t] - samp[b, t]), cap) if level == "token" else seq_w
    x = t64(train).requires_grad_(True)
    w = tis_weights(x, t64(samp), tmask(mask), cap=cap, level=level)
    close(w, ref)
    assert not w.requires_grad
    if cap == 1.0:
        assert (w <= 1.0).all()
    with pytest.raises(ValueError):
        tis_weights(x, t64(samp), tmask(mask), cap=cap, level="step")


def ref_mis_keep(train, samp, mask, low, high, level):
    keep = np.zeros_like(mask)
    for b in range(mask.shape[0]):
        pos = action_positions(mask[b])
        if not pos:
            continue
        geo = math.exp(sum(train[b, t] - samp[b, t] for t in pos) / len(pos))
        for t in pos:
            r = math.exp(train[b, t] - samp[b, t]) if level == "token" else geo
            keep[b, t] = float(low <= r <= high)
    return keep


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("low,high", [(0.5, 2.0), (0.9, 1.1)])
def test_masked_importance_sampling_keeps_what_is_within_bounds(level, low, high):
    rng = np.random.default_rng(19)
    B, T = 8, 25
    mask = ragged_mask(rng, B, T, empty_row=True)
    samp = -np.abs(rng.normal(size=(B, T)))
    train = samp + rng.normal(size=(B, T)) * 0.5 + rng.normal(size=(B, 1))  # rows drift apart: sequences differ
    train[mask == 0] = 30.0  # off the action tokens: never decides anything
    ref = ref_mis_keep(train, samp, mask, low, high, level)
    keep = mis_keep(t64(train).requires_grad_(True), t64(samp), tmask(mask), low, high, level=level)
    close(keep, ref)
    assert not keep.requires_grad
    assert 0 < ref[mask > 0].mean() < 1  # some kept, some masked: the case is not trivial
    with pytest.raises(ValueError, match="0 < low < 1 < high"):
        mis_keep(t64(train), t64(samp), tmask(mask), 1.2, 2.0)
    with pytest.raises(ValueError, match="valid levels: token, sequence"):
        mis_keep(t64(train), t64(samp), tmask(mask), low, high, level="row")


def test_sampler_mismatch_sums():
    rng = np.random.default_rng(18)
    mask = ragged_mask(rng, 5, 30)
    samp = -np.abs(rng.normal(size=(5, 30)))
    train = samp + rng.normal(size=(5, 30)) * 0.1
    train[mask == 0] = 50.0  # must not leak into max_ratio
    d = (train - samp)[mask > 0]
    r = np.exp(d)
    st = sampler_mismatch_sums(t64(train), t64(samp), tmask(mask))
    close(st["kl"], np.sum(r - 1 - d))
    close(st["max_ratio"], r.max())
    close(st["abs_diff"], np.sum(np.abs(d)))
    same = sampler_mismatch_sums(t64(samp), t64(samp), tmask(mask))
    assert same["kl"] == 0 and same["max_ratio"] == 1 and same["abs_diff"] == 0


# ----------------------------------------------------------------------------------------------
# overlong shaping


def ref_overlong(L, Lmax, buf, pen):
    out = []
    for x in L:
        if x <= Lmax - buf:
            out.append(0.0)
        elif x <= Lmax:
            out.append(-pen * (x - (Lmax - buf)) / buf)
        else:
            out.append(-pen)
    return np.array(out)


@pytest.mark.parametrize("buf,pen", [(16, 1.0), (64, 0.5), (1, 2.0), (0, 1.0)])
def test_overlong_penalty(buf, pen):
    Lmax = 64
    L = np.array([0, 1, 20, 47, 48, 49, 55, 63, 64, 65, 100])
    got = overlong_penalty(torch.tensor(L), Lmax, buf, penalty=pen)
    assert got.is_floating_point()
    close(got, ref_overlong(L, Lmax, buf, pen))
    if buf > 0:
        assert got[L == Lmax].item() == -pen  # full penalty at max_new_tokens
    got64 = overlong_penalty(t64(L), Lmax, buf, penalty=pen)
    assert got64.dtype == torch.float64
    close(got64, ref_overlong(L, Lmax, buf, pen))
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor(L), Lmax, Lmax + 1)


# ----------------------------------------------------------------------------------------------
# token-level rewards and returns (REINFORCE++ / PPO)


def ref_token_rewards(R, mask, kl, coef):
    B, T = mask.shape
    out = np.zeros((B, T))
    for b in range(B):
        pos = action_positions(mask[b])
        for t in pos:
            out[b, t] = -coef * kl[b, t] if kl is not None else 0.0
        if pos:
            out[b, pos[-1]] += R[b]
    return out


def ref_returns(r, mask, gamma):
    B, T = r.shape
    out = np.zeros((B, T))
    for b in range(B):
        pos = action_positions(mask[b])
        for k, t in enumerate(pos):
            out[b, t] = sum(gamma ** j * r[b, pos[k + j]] for j in range(len(pos) - k))
    return out


@pytest.mark.parametrize("coef", [0.0, 0.05])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_token_rewards_and_discounted_returns(coef, gamma):
    rng = np.random.default_rng(20)
    B, T = 6, 35
    mask = ragged_mask(rng, B, T, empty_row=True)
    R = rng.normal(size=B)
    kl = rng.normal(size=(B, T))
    kl[mask == 0] = np.nan  # off-mask KL must not leak
    tr = token_level_rewards(t64(R), tmask(mask), t64(kl), coef)
    ref_r = ref_token_rewards(R, mask, np.nan_to_num(kl), coef)
    close(tr, ref_r)
    close(discounted_returns(tr, tmask(mask), gamma), ref_returns(ref_r, mask, gamma))
    # no KL: only the outcome on the last action token
    close(token_level_rewards(t64(R), tmask(mask)), ref_token_rewards(R, mask, None, 0.0))


# ----------------------------------------------------------------------------------------------
# critic


def ref_value_loss(v, old, R, mask, clip):
    out = np.zeros_like(v)
    for b in range(v.shape[0]):
        for t in action_positions(mask[b]):
            a = (v[b, t] - R[b, t]) ** 2
            if clip is None:
                out[b, t] = 0.5 * a
            else:
                vc = old[b, t] + min(max(v[b, t] - old[b, t], -clip), clip)
                out[b, t] = 0.5 * max(a, (vc - R[b, t]) ** 2)
    return out


@pytest.mark.parametrize("clip", [None, 0.2, 0.5])
def test_value_loss_values_grads_and_clip_fraction(clip):
    rng = np.random.default_rng(21)
    B, T = 6, 30
    mask = ragged_mask(rng, B, T, empty_row=True)
    old = rng.normal(size=(B, T))
    v = old + rng.normal(size=(B, T)) * 0.5
    R = rng.normal(size=(B, T))
    x = t64(v).requires_grad_(True)
    tl, stats = value_loss(x, t64(old), t64(R), tmask(mask), clip)
    close(tl, ref_value_loss(v, old, R, mask, clip))
    # the aggregated loss (global token mean) and its gradient
    n = float(mask.sum())
    loss = aggregate_loss(tl, tmask(mask), "all_token_mean", n_tokens_global=n, n_seqs_global=B)
    close(loss, ref_value_loss(v, old, R, mask, clip).sum() / n)
    loss.backward()
    close(x.grad, num_grad(lambda z: ref_value_loss(z, old, R, mask, clip).sum() / n, v))
    sel = mask > 0
    if clip is None:
        close(stats["clip_fraction"], 0.0)
    else:
        vc = old + np.clip(v - old, -clip, clip)
        cut = ((vc - R) ** 2 > (v - R) ** 2)[sel]
        close(stats["clip_fraction"], cut.mean())
        assert cut.any()
    close(stats["values"], v[sel].mean())
    close(stats["returns"], R[sel].mean())


def test_explained_variance_from_moments():
    rng = np.random.default_rng(22)
    mask = ragged_mask(rng, 5, 30)
    R = rng.normal(size=(5, 30))
    V = R + rng.normal(size=(5, 30)) * 0.5
    sel = mask > 0
    ref = 1 - np.var(R[sel] - V[sel]) / np.var(R[sel])
    # from all-reduced moments: two "ranks" summed give the whole batch's value
    parts = [(R[:2], V[:2], mask[:2]), (R[2:], V[2:], mask[2:])]
    sums = np.zeros(5)
    for r, v, m in parts:
        s = m > 0
        e = r[s] - v[s]
        sums += [s.sum(), r[s].sum(), (r[s] ** 2).sum(), e.sum(), (e ** 2).sum()]
    close(explained_variance_from_moments(*sums), ref)
    n, sr, sr2 = R[sel].size, R[sel].sum(), (R[sel] ** 2).sum()
    close(explained_variance_from_moments(n, sr, sr2, 0.0, 0.0), 1.0)  # a perfect critic
    assert math.isnan(explained_variance_from_moments(n, float(n), float(n), 0.0, 0.0))  # Var(R) = 0


def test_merge_moments_equals_concatenated_data():
    rng = np.random.default_rng(23)
    chunks = [rng.normal(loc=rng.normal(), scale=rng.uniform(0.1, 3), size=int(rng.integers(1, 40)))
              for _ in range(7)]
    count, mean, var = 0.0, 0.0, 0.0
    for c in chunks:
        count, mean, var = merge_moments(count, mean, var, len(c), float(np.mean(c)), float(np.var(c)))
    allv = np.concatenate(chunks)
    close(count, len(allv)), close(mean, np.mean(allv)), close(var, np.var(allv))
    assert merge_moments(0, 0, 0, 0, 0, 0) == (0.0, 0.0, 0.0)


def ref_entropy_coef(k, total, c0, floor, kind):
    if kind == "constant":
        return c0
    p = min(1.0, k / total)
    v = c0 - (c0 - floor) * p if kind == "linear" else floor + (c0 - floor) * (1 + math.cos(math.pi * p)) / 2
    return max(v, floor)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_entropy_coef_schedule(kind):
    total, c0, floor = 40, 0.01, 0.002
    got = [entropy_coef_schedule(k, total, c0, floor, kind) for k in range(60)]
    close(got, [ref_entropy_coef(k, total, c0, floor, kind) for k in range(60)])
    assert got[0] == c0
    if kind != "constant":
        assert min(got) >= floor and got[-1] == pytest.approx(floor)  # the floor holds after the decay
        assert all(a >= b - 1e-15 for a, b in zip(got, got[1:]))  # non-increasing
    with pytest.raises(ValueError):
        entropy_coef_schedule(0, 10, 0.01, 0.0, "step")


# ----------------------------------------------------------------------------------------------
# DAPO dynamic sampling


def test_informative_groups():
    r = t64([1, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5, 2, 2, 2.0000001])
    assert informative_groups(r, 3).tolist() == [False, True, False, True]
    assert informative_groups(t64([1.0, 2.0]), 1).tolist() == [False, False]  # a group of one: no signal


def ref_split_quota(counts, target):
    """Round-robin: one item at a time to the next rank that still has one."""
    keep = [0] * len(counts)
    left = min(target, sum(counts))
    r = 0
    while left:
        if keep[r] < counts[r]:
            keep[r] += 1
            left -= 1
        r = (r + 1) % len(counts)
    return keep


@pytest.mark.parametrize("counts,target", [([3, 5], 4), ([0, 9], 4), ([1, 1, 7, 0], 6), ([2, 2], 9),
                                           ([4, 4, 4], 12), ([5, 0, 3, 8], 7), ([0, 0], 3), ([1, 5, 5], 6),
                                           ([4, 4, 4], 7), ([2, 9, 1, 6], 11)])
def test_split_quota(counts, target):
    got = split_quota(counts, target)
    assert sum(got) == min(target, sum(counts))
    assert all(0 <= g <= c for g, c in zip(got, counts))
    assert got == ref_split_quota(counts, target)
    # as even as the counts allow: no rank keeps 2+ more than a rank that had items left over
    for i, (gi, ci) in enumerate(zip(got, counts)):
        for gj, cj in zip(got, counts):
            if cj > gj:
                assert gi <= gj + 1
