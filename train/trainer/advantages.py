"""Advantages (and the critic's returns) of every estimator, computed in place on the step batch.

Each dp group holds its own samples (train/parallel/step_batch.py); a group of responses may be
spread over several dp groups. Statistics are therefore built from sums: every dp group's leader
adds its samples' per-group counts, sums and sums of squares (and the KL and token moments), one
all-reduce combines them, and every rank finishes its own samples from the global numbers. All in
float64; the results are written as per-token float32 fields ([len - 1], zero off the action tokens).

- reinforce / rloo: one value per sequence (group mean baseline, Bessel-corrected std with
  `adv.norm_var`; leave-one-out), or with `adv.global_norm` one baseline for the whole batch;
  `adv.batch_whiten` whitens the per-group advantages by the batch's mean and std. KL in the reward
  is summed over the sequence: r - coef * sum_t KL_t.
- reinforce_pp(_baseline): token rewards (-coef * KL_t on every action token, the outcome (minus the
  group mean for _baseline) on the last), discounted returns-to-go over action tokens with
  `adv.gamma`, normalised by the all-rank token mean/std (REINFORCE++).
- gae: the same token rewards times `reward_scale`, GAE(`adv.gamma`, `adv.lamda`) over action tokens
  with the critic's values; returns A + V are the critic's targets; advantages whitened over all
  ranks' action tokens if `adv.whiten`.
The policy's log-probs for KL in the reward are the recomputed old log-probs when there are any,
else the sampler's.
"""
from __future__ import annotations

import math

import torch
from omegaconf import DictConfig

from train.parallel.collectives import all_reduce_sum
from train.parallel.step_batch import StepBatch
from train.utils import algorithms as alg

SEQUENCE_ESTIMATORS = ("reinforce", "rloo")  # one advantage per sequence
TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")  # one advantage per action token
ESTIMATORS = SEQUENCE_ESTIMATORS + TOKEN_ESTIMATORS


def padded(per_sample: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-sample [len-1] tensors -> [n, width] float64, zero padded."""
    out = torch.zeros(len(per_sample), width, dtype=torch.float64)
    for i, v in enumerate(per_sample):
        out[i, : v.numel()] = v.double()
    return out


def unpadded(x: torch.Tensor, batch: StepBatch) -> list[torch.Tensor]:
    return [x[i, : batch.mask[i].numel()].float().clone() for i in range(len(batch))]


def compute_advantages(batch: StepBatch, cfg: DictConfig, device: torch.device,
                       reward_scale: float = 1.0) -> dict[str, float]:
    """Write `advantages` (and for gae `returns`) into batch.fields; return the advantage metrics."""
    n = len(batch)
    lead = 1.0 if batch.is_leader else 0.0
    width = max([m.numel() for m in batch.mask] + [1])
    mask = padded(batch.mask, width) > 0
    rewards = batch.rewards
    kl_cfg = cfg.actor.kl
    estimator = cfg.adv.estimator
    has_ref = "ref_logp" in batch.fields
    kl_in_reward = has_ref and kl_cfg.reward_estimator is not None and kl_cfg.coef > 0
    kl_tok = None
    if has_ref:
        policy = batch.fields.get("old_logp", batch.sampler_logp)
        kind = kl_cfg.reward_estimator if kl_in_reward else kl_cfg.type
        kl_tok = torch.where(mask, alg.kl_estimate(padded(policy, width), padded(batch.fields["ref_logp"], width),
                                                   kind), torch.zeros((), dtype=torch.float64))
        if kl_in_reward and estimator in SEQUENCE_ESTIMATORS:
            rewards = rewards - kl_cfg.coef * kl_tok.sum(dim=1)

    # One all-reduce: per-group sums of the (KL-shaped) rewards, batch sums, and the KL metric's sums.
    groups = batch.groups
    n_groups = batch.index.n_groups
    local = [alg.group_sums(rewards, groups, n_groups).reshape(-1) * lead,
             torch.tensor(alg.masked_sums(rewards, torch.ones(n, dtype=torch.bool)), dtype=torch.float64) * lead]
    if kl_tok is not None:
        local.append(torch.tensor([float(kl_tok.sum()), float(n), float(mask.sum())], dtype=torch.float64) * lead)
    flat = torch.tensor(all_reduce_sum(torch.cat(local).tolist(), device), dtype=torch.float64)
    sums = flat[: 3 * n_groups].view(n_groups, 3)
    batch_count, batch_sum, batch_sq = flat[3 * n_groups: 3 * n_groups + 3].tolist()
    metrics: dict[str, float] = {}
    if kl_tok is not None:
        kl_total, sequences, tokens = flat[3 * n_groups + 3:].tolist()
        metrics[f"kl/{kind}"] = kl_total / max(tokens, 1.0)  # per action token, policy vs reference
        if kl_in_reward:
            metrics["kl/reward_penalty"] = kl_total / max(sequences, 1.0)  # per sequence, before the coefficient

    if estimator in SEQUENCE_ESTIMATORS:
        if cfg.adv.global_norm:  # one baseline shared by the whole batch (all ranks), not per prompt
            if estimator == "rloo":
                adv = alg.shared_rloo_advantages(rewards, batch_sum, batch_count)
            else:
                mean, var = alg.mean_var_from_sums(batch_count, batch_sum, batch_sq)
                adv = alg.shared_baseline_advantages(rewards, mean, math.sqrt(var) if cfg.adv.norm_var else None)
        elif estimator == "rloo":
            adv = alg.group_rloo_from_sums(rewards, groups, sums)
        else:
            adv = alg.group_advantages_from_sums(rewards, groups, sums, cfg.adv.norm_var)
        if cfg.adv.batch_whiten:  # per-group advantages, then whitened by the batch's moments
            mean, var = alg.mean_var_from_sums(*all_reduce_sum(
                [x * lead for x in alg.masked_sums(adv, torch.ones(n, dtype=torch.bool))], device))
            adv = alg.global_normalize(adv, mean, math.sqrt(var))
        batch.fields["advantages"] = unpadded(alg.broadcast_to_tokens(adv, mask), batch)
        return metrics

    gamma = float(cfg.adv.gamma)
    kl = kl_tok if kl_in_reward else None
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        outcome = (alg.group_advantages_from_sums(rewards, groups, sums, norm_var=False)
                   if estimator == "reinforce_pp_baseline" else rewards)
        ret = alg.discounted_returns(alg.token_level_rewards(outcome, mask, kl, kl_cfg.coef), mask, gamma)
        mean, var = alg.mean_var_from_sums(*all_reduce_sum([x * lead for x in alg.masked_sums(ret, mask)], device))
        adv = torch.where(mask, alg.global_normalize(ret, mean, math.sqrt(var)), torch.zeros((), dtype=ret.dtype))
        batch.fields["advantages"] = unpadded(adv, batch)
        return metrics

    if estimator != "gae":
        raise ValueError(f"unknown adv.estimator {estimator!r}")
    token_r = alg.token_level_rewards(rewards, mask, kl, kl_cfg.coef) * reward_scale
    values = padded(batch.fields["values"], width)
    adv, ret = alg.gae(token_r, values, mask, gamma, float(cfg.adv.lamda))
    err = ret - values
    # One all-reduce: returns and errors for explained variance, advantages for whitening.
    stats = all_reduce_sum([x * lead for x in (*alg.masked_sums(ret, mask), *alg.masked_sums(err, mask)[1:],
                                               *alg.masked_sums(adv, mask)[1:])], device)
    n_tok, sr, sr2, se, se2, sa, sa2 = stats
    ev = alg.explained_variance_from_moments(n_tok, sr, sr2, se, se2)
    if math.isfinite(ev):  # undefined when every return is equal
        metrics["critic/explained_variance"] = ev
    metrics["critic/returns"] = sr / max(n_tok, 1.0)
    metrics["critic/reward_scale"] = reward_scale
    if cfg.adv.whiten:
        mean, var = alg.mean_var_from_sums(n_tok, sa, sa2)
        adv = alg.whiten(adv, mask, mean, var)
    batch.fields["advantages"] = unpadded(adv, batch)
    batch.fields["returns"] = unpadded(ret, batch)
    return metrics
