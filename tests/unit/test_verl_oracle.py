"""Our policy losses and the masked importance sampling against verl 0.9.1's own functions (the
oracle: requirements-oracle.txt, loaded by conftest's `verl_oracle`), on random ragged float64 batches:
the aggregated loss and its gradient with respect to the log-probs, for each aggregation mode verl
shares. Where a definition differs on purpose, the test says how (docs/algorithms.md too)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import verl_oracle
from train.algorithms.aggregation import aggregate_loss
from train.algorithms.mismatch import mis_keep
from train.algorithms.policy_loss import POLICY_LOSSES, LossSettings

# our actor.agg_mode -> verl's loss_agg_mode
AGG = {"all_token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
       "seq_mean_token_sum": "seq-mean-token-sum"}


def batch(seed: int, B: int = 8, T: int = 20, spread: float = 0.5, row_spread: float | None = None):
    """Right-padded responses of random lengths (every row has tokens), log-probs whose ratios reach
    both clip bounds, and one advantage per row (GRPO's) broadcast to its tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    old = -np.abs(rng.normal(size=(B, T))) - 0.1
    row_spread = spread / 4 if row_spread is None else row_spread
    new = old + rng.normal(size=(B, T)) * spread + rng.normal(size=(B, 1)) * row_spread
    adv = np.repeat(rng.normal(size=(B, 1)), T, axis=1)
    return (torch.tensor(x, dtype=torch.float64) for x in (new, old, adv, mask))


def verl_config(clip_low: float, clip_high: float, policy_loss: dict | None = None, **extra):
    _, _, ActorConfig = verl_oracle()
    from verl.workers.config.actor import PolicyLossConfig
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1, clip_ratio=clip_low,
                       clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                       policy_loss=PolicyLossConfig(**(policy_loss or {})), **extra)


def tolerance(agg: str) -> dict:
    """verl's seq-mean-token-mean divides each row's sum by (its token count + 1e-8): a relative 1e-8 apart."""
    return dict(rtol=1e-7, atol=1e-12) if agg == "seq_mean_token_mean" else dict(rtol=1e-10, atol=1e-12)


def ours(name: str, new, old, adv, mask, agg: str, clip_low: float, clip_high: float, **kw):
    """Our registered loss through our aggregation, as the actor runs them (one rank: global = local)."""
    x = new.clone().requires_grad_(True)
    token_loss, _ = POLICY_LOSSES.get(name)(x, old, adv, mask, LossSettings(clip_low, clip_high, **kw))
    n_seqs = float((mask.sum(1) > 0).sum())
    value = aggregate_loss(token_loss, mask, agg, n_tokens_global=float(mask.sum()), n_seqs_global=n_seqs,
                           max_len_norm=mask.shape[1])
    value.backward()
    return value.detach(), x.grad


def theirs(name: str, new, old, adv, mask, agg: str, config):
    core, _, _ = verl_oracle()
    x = new.clone().requires_grad_(True)
    value, _ = core.get_policy_loss_fn(name)(old, x, adv, mask, AGG[agg], config)
    value.backward()
    return value.detach(), x.grad


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("clip_low,clip_high", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_with_dual_clip_matches_verl_vanilla(agg, clip_low, clip_high):
    """verl's `vanilla` always applies the dual clip (clip_ratio_c, 3.0); ours with actor.dual_clip=3."""
    new, old, adv, mask = batch(1)
    a = ours("ppo", new, old, adv, mask, agg, clip_low, clip_high, dual_clip=3.0)
    b = theirs("vanilla", new, old, adv, mask, agg, verl_config(clip_low, clip_high, clip_ratio_c=3.0))
    torch.testing.assert_close(a, b, **tolerance(agg))


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("clip_low,clip_high", [(0.2, 0.28), (1.0, 5.0)])
def test_cispo_matches_verl(agg, clip_low, clip_high):
    new, old, adv, mask = batch(2, spread=0.9)  # ratios past 1 + 5 too
    a = ours("cispo", new, old, adv, mask, agg, clip_low, clip_high)
    b = theirs("cispo", new, old, adv, mask, agg, verl_config(clip_low, clip_high))
    torch.testing.assert_close(a, b, **tolerance(agg))


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("clip_low,clip_high", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_matches_verl(agg, clip_low, clip_high):
    new, old, adv, mask = batch(3, spread=0.05)
    a = ours("gspo", new, old, adv, mask, agg, clip_low, clip_high)
    b = theirs("gspo", new, old, adv, mask, agg, verl_config(clip_low, clip_high))
    torch.testing.assert_close(a, b, **tolerance(agg))


@pytest.mark.parametrize("clip", [0.4, 0.1])
def test_gmpo_matches_verl_geo_mean(clip):
    """verl's geo_mean takes a plain mean over rows whatever loss_agg_mode says: our seq_mean_token_mean."""
    new, old, adv, mask = batch(5, spread=0.3)
    a = ours("gmpo", new, old, adv, mask, "seq_mean_token_mean", clip, clip)
    b = theirs("geo_mean", new, old, adv, mask, "seq_mean_token_mean", verl_config(clip, clip))
    torch.testing.assert_close(a, b, **tolerance("seq_mean_token_mean"))


@pytest.mark.parametrize("agg", list(AGG))
def test_gpg_matches_verl(agg):
    new, old, adv, mask = batch(6)
    a = ours("gpg", new, old, adv, mask, agg, 0.2, 0.2)
    b = theirs("gpg", new, old, adv, mask, agg, verl_config(0.2, 0.2))
    torch.testing.assert_close(a, b, **tolerance(agg))


@pytest.mark.parametrize("level,option", [("token", "token_k1"), ("sequence", "seq_mean_k1")])
@pytest.mark.parametrize("low,high", [(0.5, 2.0), (0.8, 1.5)])
def test_masked_importance_sampling_matches_verl_rejection_mask(level, option, low, high):
    """verl's k1 rejection bounds apply to pi_rollout / pi_trainer (k1 = -log(pi_trainer / pi_rollout)); ours to
    pi_trainer / pi_sampler, the direction of the TIS weight. So actor.mis_low=a, actor.mis_high=b is verl's
    rollout_rs_threshold "1/b_1/a": the same tokens (or sequences, by the geometric mean) are kept."""
    _, corr, _ = verl_oracle()
    trainer, sampler, _, mask = batch(4, B=16, spread=0.6, row_spread=0.6)
    keep = mis_keep(trainer, sampler, mask, low, high, level=level)
    verl_mask, _ = corr.compute_rollout_rejection_mask(trainer - sampler, mask, option, f"{1 / high}_{1 / low}")
    assert 0 < float((keep * mask).sum()) < float(mask.sum())  # some kept, some masked
    torch.testing.assert_close(keep * mask, verl_mask.to(keep.dtype) * mask, rtol=0, atol=0)


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_matches_verl(tau_pos, tau_neg):
    """verl's sapo aggregates per sequence whatever loss_agg_mode says: our seq_mean_token_mean (its preset)."""
    new, old, adv, mask = batch(7, spread=0.6)
    a = ours("sapo", new, old, adv, mask, "seq_mean_token_mean", 0.2, 0.2, tau_pos=tau_pos, tau_neg=tau_neg)
    b = theirs("sapo", new, old, adv, mask, "seq_mean_token_mean", verl_config(0.2, 0.2, tau_pos=tau_pos,
                                                                                  tau_neg=tau_neg))
    torch.testing.assert_close(a, b, **tolerance("seq_mean_token_mean"))


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_dro_matches_verl(agg, beta):
    new, old, adv, mask = batch(8)
    a = ours("dro", new, old, adv, mask, agg, 0.2, 0.2, dro_beta=beta)
    b = theirs("dro", new, old, adv, mask, agg, verl_config(0.2, 0.2, policy_loss=dict(dro_beta=beta)))
    torch.testing.assert_close(a, b, **tolerance(agg))


def probability_batch(seed: int):
    """As batch(), with log-probs of real probabilities (DPPO reads p = exp(logp) itself) that move by up to ~0.4."""
    new, old, adv, mask = batch(seed, spread=0.9)
    rng = np.random.default_rng(seed + 100)
    p_old = torch.tensor(rng.uniform(0.02, 0.98, size=old.shape))
    p_new = (p_old + torch.tensor(rng.normal(size=old.shape)) * 0.2).clamp(1e-3, 1 - 1e-3)
    return p_new.log(), p_old.log(), adv, mask


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("low,high,cap", [(0.2, 0.2, 20.0), (0.02, 0.05, 1.5)])
def test_dppo_matches_verl(agg, name, low, high, cap):
    """verl reads the weight's ceiling from clip_ratio_c (its ActorConfig default 3.0; the loss's own fallback 20):
    our actor.dppo_ratio_cap (20.0)."""
    new, old, adv, mask = probability_batch(9)
    a = ours(name, new, old, adv, mask, agg, low, high, ratio_cap=cap)
    b = theirs(name, new, old, adv, mask, agg, verl_config(low, high, clip_ratio_c=cap))
    torch.testing.assert_close(a, b, **tolerance(agg))


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("low,high", [(0.05, 5.0), (0.2, 1.0)])
def test_clip_cov_matches_verl_when_every_candidate_is_held(agg, low, high):
    """Both draw the held-back tokens at random among the candidates (verl from the global stream, ours from a
    generator seeded by the micro-batch): with a share of tokens above the candidates' count both hold them
    all, and the numbers must agree exactly; tests/unit/test_algorithms.py checks the draw itself."""
    new, old, adv, mask = batch(10, spread=0.3)
    a = ours("clip_cov", new, old, adv, mask, agg, 0.2, 0.28, cov_ratio=0.99, cov_low=low, cov_high=high)
    b = theirs("clip_cov", new, old, adv, mask, agg, verl_config(0.2, 0.28, policy_loss=dict(
        clip_cov_ratio=0.99, clip_cov_lb=low, clip_cov_ub=high)))
    torch.testing.assert_close(a, b, **tolerance(agg))
    settings = LossSettings(0.2, 0.28, cov_ratio=0.99, cov_low=low, cov_high=high)
    held = POLICY_LOSSES.get("clip_cov")(new, old, adv, mask, settings)[1]["clip_fraction"]
    assert held > POLICY_LOSSES.get("ppo")(new, old, adv, mask, settings)[1]["clip_fraction"]  # some were held


@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("share,coef", [(0.0002, 1.0), (0.2, 0.1)])
def test_kl_cov_matches_verl(agg, share, coef):
    new, old, adv, mask = batch(11, spread=0.3)
    a = ours("kl_cov", new, old, adv, mask, agg, 0.2, 0.2, cov_ratio=share, kl_cov_coef=coef)
    b = theirs("kl_cov", new, old, adv, mask, agg, verl_config(0.2, 0.2, policy_loss=dict(
        kl_cov_ratio=share, ppo_kl_coef=coef)))
    torch.testing.assert_close(a, b, **tolerance(agg))
