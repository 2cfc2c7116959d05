"""Advantages (and the critic's returns) on the step batch: the distributed part around the
estimators of train/algorithms/advantages.py, chosen by `adv.estimator` from their registry.

Each dp group holds its own samples (train/parallel/step_batch.py); a group of responses may be
spread over several dp groups. Statistics are therefore built from sums: every dp group's leader
adds its samples' per-group counts, sums and sums of squares (and the KL and token moments), one
all-reduce combines them, and every rank finishes its own samples from the global numbers (the
estimator's later sums go through the same all-reduce, `global_sum`). All in float64; the results
are written as per-token float32 fields ([len - 1], zero off the action tokens).

KL in the reward: per-sequence estimators (reinforce, rloo) get r - coef * sum_t KL_t; per-token
ones (reinforce_pp(_baseline), gae) -coef * KL_t on every action token. The policy's log-probs for
it are the recomputed old log-probs when there are any, else the sampler's.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from train.algorithms.advantages import ESTIMATORS, AdvantageInputs, AdvantageSettings
from train.algorithms.config import AdvConfig, DistillConfig
from train.algorithms.distillation import distill_advantages
from train.algorithms.kl import kl_estimate
from train.algorithms.moments import group_sums, masked_sums
from train.models.config import KLConfig
from train.parallel.collectives import all_reduce_sum
from train.parallel.step_batch import StepBatch


def padded(per_sample: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-sample [len-1] tensors -> [n, width] float64, zero padded."""
    out = torch.zeros(len(per_sample), width, dtype=torch.float64)
    for i, v in enumerate(per_sample):
        out[i, : v.numel()] = v.double()
    return out


def unpadded(x: torch.Tensor, batch: StepBatch) -> list[torch.Tensor]:
    return [x[i, : batch.mask[i].numel()].float().clone() for i in range(len(batch))]


def compute_advantages(batch: StepBatch, adv: AdvConfig, kl_cfg: KLConfig, device: torch.device,
                       reward_scale: float = 1.0, distill: DistillConfig | None = None) -> dict[str, float]:
    """Write `advantages` (and for an estimator with a critic `returns`) into batch.fields; return
    the advantage metrics. `kl_cfg` (actor.kl) says whether and how KL enters the reward; with
    `distill.teacher` the reference slot's log-probs are the teacher's, and the estimator's advantage
    is combined with the per-token reverse KL to it (train/algorithms/distillation.py)."""
    n = len(batch)
    lead = 1.0 if batch.is_leader else 0.0
    width = max([m.numel() for m in batch.mask] + [1])
    mask = padded(batch.mask, width) > 0
    rewards = batch.rewards
    estimator = ESTIMATORS.get(adv.estimator)
    has_ref = "ref_logp" in batch.fields
    kl_in_reward = has_ref and kl_cfg.reward_estimator is not None and kl_cfg.coef > 0
    teacher_on = has_ref and distill is not None and distill.enabled  # ref_logp: the teachers'
    kl_tok = None
    if has_ref:
        policy = padded(batch.fields.get("old_logp", batch.sampler_logp), width)
        ref = padded(batch.fields["ref_logp"], width)
        if teacher_on:  # a sample no teacher scores (distill.teachers, route -1): no reverse KL, its reward alone
            taught = torch.tensor([batch.index.route[g] >= 0 for g in batch.members], dtype=torch.bool)
            ref = torch.where(taught[:, None], ref, policy)
        kind = kl_cfg.reward_estimator if kl_in_reward else kl_cfg.type
        kl_tok = torch.where(mask, kl_estimate(policy, ref, kind), torch.zeros((), dtype=torch.float64))
        if kl_in_reward and estimator.per_sequence:
            rewards = rewards - kl_cfg.coef * kl_tok.sum(dim=1)

    def global_sum(values: Sequence[float]) -> list[float]:
        """Sum over all ranks' samples: each dp group's leader counts its samples once."""
        return all_reduce_sum([x * lead for x in values], device)

    # One all-reduce: per-group sums of the (KL-shaped) rewards, batch sums, the KL metric's sums and, with a
    # distillation teacher, the sum of log pi_student - log pi_teacher over action tokens.
    groups = batch.groups
    n_groups = batch.index.n_groups
    local = [group_sums(rewards, groups, n_groups).reshape(-1) * lead,
             torch.tensor(masked_sums(rewards, torch.ones(n, dtype=torch.bool)), dtype=torch.float64) * lead]
    if kl_tok is not None:
        sums = [float(kl_tok.sum()), float(n), float(mask.sum())]
        if teacher_on:
            sums += [float(torch.where(mask, policy - ref, torch.zeros((), dtype=torch.float64)).sum()),
                     float((mask & taught[:, None]).sum())]
        local.append(torch.tensor(sums, dtype=torch.float64) * lead)
    flat = torch.tensor(all_reduce_sum(torch.cat(local).tolist(), device), dtype=torch.float64)
    metrics: dict[str, float] = {}
    if kl_tok is not None:
        kl_total, sequences, tokens, *reverse_kl = flat[3 * n_groups + 3:].tolist()
        metrics[f"kl/{kind}"] = kl_total / max(tokens, 1.0)  # per action token, policy vs reference
        if kl_in_reward:
            metrics["kl/reward_penalty"] = kl_total / max(sequences, 1.0)  # per sequence, before the coefficient
        if teacher_on:  # per action token a teacher scored, log pi_student - log pi_teacher
            metrics["distill/reverse_kl"] = reverse_kl[0] / max(reverse_kl[1], 1.0)
            metrics["distill/taught_share"] = reverse_kl[1] / max(tokens, 1.0)  # < 1: sources without a teacher

    inputs = AdvantageInputs(
        rewards=rewards, mask=mask, groups=groups, group_sums=flat[: 3 * n_groups].view(n_groups, 3),
        batch_sums=tuple(flat[3 * n_groups: 3 * n_groups + 3].tolist()), global_sum=global_sum,
        token_kl=kl_tok if kl_in_reward and not estimator.per_sequence else None, kl_coef=float(kl_cfg.coef),
        values=padded(batch.fields["values"], width) if estimator.needs_critic else None, reward_scale=reward_scale)
    settings = AdvantageSettings(norm_var=bool(adv.norm_var), global_norm=bool(adv.global_norm),
                                 batch_whiten=bool(adv.batch_whiten), gamma=float(adv.gamma),
                                 lamda=float(adv.lamda), whiten=bool(adv.whiten))
    result = estimator.fn(inputs, settings)
    metrics.update(result.metrics)
    advantages = result.advantages
    if teacher_on:
        advantages = distill_advantages(advantages, policy, ref, mask, distill.coef, distill.reward_coef)
    batch.fields["advantages"] = unpadded(advantages, batch)
    if result.returns is not None:
        batch.fields["returns"] = unpadded(result.returns, batch)
    return metrics
