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
from train.algorithms.policy_loss import POLICY_LOSSES

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


def verl_config(clip_low: float, clip_high: float, **extra):
    _, _, ActorConfig = verl_oracle()
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1, clip_ratio=clip_low,
                       clip_ratio_low=clip_low, clip_ratio_high=clip_high, **extra)


def tolerance(agg: str) -> dict:
    """verl's seq-mean-token-mean divides each row's sum by (its token count + 1e-8): a relative 1e-8 apart."""
    return dict(rtol=1e-7, atol=1e-12) if agg == "seq_mean_token_mean" else dict(rtol=1e-10, atol=1e-12)


def ours(name: str, new, old, adv, mask, agg: str, clip_low: float, clip_high: float, **kw):
    """Our registered loss through our aggregation, as the actor runs them (one rank: global = local)."""
    x = new.clone().requires_grad_(True)
    token_loss, _ = POLICY_LOSSES.get(name)(x, old, adv, mask, clip_low, clip_high, **kw)
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
