"""Advantage estimators, registered by name (`adv.estimator` chooses one).

An estimator is a function of plain tensors (`AdvantageInputs`: rewards, group ids, the action mask,
the critic's values, the KL penalty per token) plus the global sums the caller supplies: the
per-group and whole-batch (count, sum, sum of squares) of the rewards over all ranks, and
`global_sum`, the caller's sum over all ranks for statistics of intermediate results (whitening,
normalising returns). It returns per-token advantages [B, T] (0 off the action tokens), the critic's
returns for estimators that train one, and metrics. Nothing here communicates: on one process
`global_sum` is the identity (train/trainer/advantages.py passes an all-reduce).

Adding an estimator: one function registered with `@estimator("name", per_sequence=...)`, and its
float64 reference test (docs/design.md, "Add an estimator").
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from train.algorithms.masks import broadcast_to_tokens
from train.algorithms.moments import global_normalize, masked_sums, mean_var_from_sums, whiten
from train.algorithms.moments import explained_variance_from_moments
from train.algorithms.registry import Registry
from train.algorithms.returns import discounted_returns, gae, token_level_rewards


@dataclass(frozen=True)
class AdvantageSettings:
    """The `adv.*` keys the estimators read (config/grpo.yaml documents each)."""
    norm_var: bool = True  # divide group advantages by the group's std (GRPO; false: Dr. GRPO)
    global_norm: bool = False  # one baseline for the whole batch instead of per group (reinforce, rloo)
    batch_whiten: bool = False  # whiten group advantages by the batch's mean and std (reinforce, rloo)
    gamma: float = 1.0  # discount over action tokens (token estimators)
    lamda: float = 1.0  # GAE's lambda
    whiten: bool = False  # whiten GAE advantages over all ranks' action tokens


@dataclass(frozen=True)
class AdvantageInputs:
    """One rank's samples as padded tensors, and the global sums their statistics need."""
    rewards: Tensor  # [B] float64 outcome rewards; per-sequence estimators get them minus coef * sum_t KL_t
    mask: Tensor  # [B, T] bool, action tokens
    groups: Tensor  # [B] group id of each sample (samples of one prompt share it)
    group_sums: Tensor  # [n_groups, 3] float64 (count, sum, sum of squares) of rewards per group, all ranks
    batch_sums: tuple[float, float, float]  # (count, sum, sum of squares) of rewards, all ranks
    global_sum: Callable[[Sequence[float]], list[float]]  # sums numbers over all ranks' samples
    token_kl: Tensor | None = None  # [B, T] KL penalty per token when KL is in the reward (token estimators)
    kl_coef: float = 0.0
    values: Tensor | None = None  # [B, T] float64 critic values (estimators that need a critic)
    reward_scale: float = 1.0  # this step's scale of the rewards the critic learns (trainer/step.py)


@dataclass
class AdvantageResult:
    advantages: Tensor  # [B, T], 0 off the action tokens
    returns: Tensor | None = None  # [B, T] the critic's targets, or None without a critic
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimator:
    fn: Callable[[AdvantageInputs, AdvantageSettings], AdvantageResult]
    # One advantage per sequence: KL in the reward enters as r - coef * sum_t KL_t, before the group
    # sums (so the caller shapes the rewards before its one all-reduce). Otherwise per token.
    per_sequence: bool
    needs_critic: bool = False  # reads `values`, returns the critic's `returns`


ESTIMATORS: Registry[Estimator] = Registry("advantage estimator", "adv.estimator")


def estimator(name: str, *, per_sequence: bool, needs_critic: bool = False):
    """Decorator: register an estimator function under `name` (see `Estimator`)."""
    def decorate(fn: Callable[[AdvantageInputs, AdvantageSettings], AdvantageResult]):
        ESTIMATORS.add(name, Estimator(fn, per_sequence, needs_critic))
        return fn
    return decorate


# ----------------------------------------------------------------------------------------------
# baselines from sums


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


# ----------------------------------------------------------------------------------------------
# the estimators


def _batch_whitened(adv: Tensor, x: AdvantageInputs) -> Tensor:
    """`adv.batch_whiten`: per-sequence advantages whitened by the batch's (all ranks') mean and std."""
    mean, var = mean_var_from_sums(*x.global_sum(masked_sums(adv, torch.ones(adv.shape[0], dtype=torch.bool))))
    return global_normalize(adv, mean, math.sqrt(var))


@estimator("reinforce", per_sequence=True)
def group_baseline(x: AdvantageInputs, s: AdvantageSettings) -> AdvantageResult:
    """GRPO: A_i = r_i - mean_g (/ std_g with `norm_var`), or with `global_norm` the batch's mean
    (and std) as the one baseline; on every action token of the sequence."""
    if s.global_norm:
        mean, var = mean_var_from_sums(*x.batch_sums)
        adv = shared_baseline_advantages(x.rewards, mean, math.sqrt(var) if s.norm_var else None)
    else:
        adv = group_advantages_from_sums(x.rewards, x.groups, x.group_sums, s.norm_var)
    if s.batch_whiten:
        adv = _batch_whitened(adv, x)
    return AdvantageResult(broadcast_to_tokens(adv, x.mask))


@estimator("rloo", per_sequence=True)
def rloo(x: AdvantageInputs, s: AdvantageSettings) -> AdvantageResult:
    """RLOO: A_i = r_i - mean of the group's other rewards (with `global_norm`, the batch's others);
    on every action token of the sequence."""
    if s.global_norm:
        count, total, _ = x.batch_sums
        adv = shared_rloo_advantages(x.rewards, total, count)
    else:
        adv = group_rloo_from_sums(x.rewards, x.groups, x.group_sums)
    if s.batch_whiten:
        adv = _batch_whitened(adv, x)
    return AdvantageResult(broadcast_to_tokens(adv, x.mask))


def _normalized_returns(outcome: Tensor, x: AdvantageInputs, s: AdvantageSettings) -> AdvantageResult:
    """REINFORCE++: token rewards (outcome on the last action token, -coef * KL_t on each),
    returns-to-go with gamma, normalised by the all-rank action-token mean and std."""
    ret = discounted_returns(token_level_rewards(outcome, x.mask, x.token_kl, x.kl_coef), x.mask, s.gamma)
    mean, var = mean_var_from_sums(*x.global_sum(masked_sums(ret, x.mask)))
    adv = torch.where(x.mask, global_normalize(ret, mean, math.sqrt(var)), torch.zeros((), dtype=ret.dtype))
    return AdvantageResult(adv)


@estimator("reinforce_pp", per_sequence=False)
def reinforce_pp(x: AdvantageInputs, s: AdvantageSettings) -> AdvantageResult:
    """REINFORCE++ on the raw outcome rewards."""
    return _normalized_returns(x.rewards, x, s)


@estimator("reinforce_pp_baseline", per_sequence=False)
def reinforce_pp_baseline(x: AdvantageInputs, s: AdvantageSettings) -> AdvantageResult:
    """REINFORCE++ on the outcome minus the group mean."""
    return _normalized_returns(group_advantages_from_sums(x.rewards, x.groups, x.group_sums, norm_var=False), x, s)


@estimator("gae", per_sequence=False, needs_critic=True)
def gae_advantages(x: AdvantageInputs, s: AdvantageSettings) -> AdvantageResult:
    """PPO with a critic: token rewards times `x.reward_scale`, GAE(gamma, lamda) over action tokens;
    returns A + V are the critic's targets; advantages whitened over all ranks' tokens with `whiten`."""
    token_r = token_level_rewards(x.rewards, x.mask, x.token_kl, x.kl_coef) * x.reward_scale
    adv, ret = gae(token_r, x.values, x.mask, s.gamma, s.lamda)
    err = ret - x.values
    # One sum over ranks: returns and errors for explained variance, advantages for whitening.
    n_tok, sr, sr2, se, se2, sa, sa2 = x.global_sum(
        [*masked_sums(ret, x.mask), *masked_sums(err, x.mask)[1:], *masked_sums(adv, x.mask)[1:]])
    metrics: dict[str, float] = {}
    ev = explained_variance_from_moments(n_tok, sr, sr2, se, se2)
    if math.isfinite(ev):  # undefined when every return is equal
        metrics["critic/explained_variance"] = ev
    metrics["critic/returns"] = sr / max(n_tok, 1.0)
    metrics["critic/reward_scale"] = x.reward_scale
    if s.whiten:
        mean, var = mean_var_from_sums(n_tok, sa, sa2)
        adv = whiten(adv, x.mask, mean, var)
    return AdvantageResult(adv, ret, metrics)
