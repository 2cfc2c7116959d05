"""The pure parts of a training step: rollout metrics, group filtering, advantages."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from train.utils import algorithms as alg
from train.utils.distributed import DistContext, all_reduce_sum
from train.workers.rollout import Sample


@dataclass
class StepInputs:
    samples: list[Sample]  # kept samples; each kept group is complete and contiguous
    group_size: int


def rollout_metrics(samples: list[Sample], n_groups: int, group_size: int, cfg: DictConfig,
                    ctx: DistContext) -> dict[str, float]:
    """Global (all-rank) rollout statistics, computed before any filtering."""
    groups = [samples[g * group_size:(g + 1) * group_size] for g in range(n_groups)]
    dropped = sum(len({s.reward for s in grp}) <= 1 for grp in groups)
    values = [
        sum(s.reward for s in samples), float(len(samples)),
        float(sum(s.n_action_tokens for s in samples)),
        float(sum(s.finish_reason == "length" for s in samples)),
        float(sum(s.n_turns for s in samples)),
        float(sum(bool(s.env_error) for s in samples)),
        float(dropped), float(n_groups),
    ]
    reward, count, tokens, clipped, turns, errors, dropped, n_groups = all_reduce_sum(values, ctx.device)
    count = max(count, 1.0)
    return {
        "rewards/train": reward / count,
        "response_length/train": tokens / count,
        "length_clip_ratio/train": clipped / count,
        "n_turns/train": turns / count,
        "env/errors": errors,
        "dynamic_filtering_ratio": dropped / max(n_groups, 1.0) if cfg.rollout.dynamic_filtering else 0.0,
    }


def filter_groups(samples: list[Sample], group_size: int, dynamic_filtering: bool,
                  mask_truncated: bool) -> list[Sample]:
    """Drop groups whose rewards are all equal (no signal) before any log-prob work; optionally
    silence truncated responses (their advantage still uses the full group's baseline)."""
    kept: list[Sample] = []
    for g in range(len(samples) // group_size):
        group = samples[g * group_size:(g + 1) * group_size]
        if dynamic_filtering and len({s.reward for s in group}) <= 1:
            continue
        kept += group
    if mask_truncated:
        for s in kept:
            if s.finish_reason == "length":
                s.action_mask = [0] * len(s.action_mask)
    return kept


def compute_advantages(inputs: StepInputs, cfg: DictConfig, ctx: DistContext,
                       ref_logp: list[torch.Tensor] | None) -> tuple[list[float], dict[str, float]]:
    """Sequence-level advantages (placed on every action token by the actor).
    With KL in the reward (actor.kl.reward_estimator), each sample's return is
    r - coef * sum_t KL_t before the group baseline."""
    samples, n = inputs.samples, inputs.group_size
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    metrics: dict[str, float] = {}
    kl_cfg = cfg.actor.kl
    if ref_logp is not None and kl_cfg.reward_estimator is not None and kl_cfg.coef > 0:
        kl = torch.tensor([
            float((alg.kl_estimate(torch.tensor(s.sampler_logprobs[1:], dtype=torch.float64),
                                   ref.double(), kl_cfg.reward_estimator)
                   * torch.tensor(s.action_mask[1:], dtype=torch.float64)).sum())
            for s, ref in zip(samples, ref_logp)], dtype=torch.float64)
        rewards = rewards - kl_cfg.coef * kl
        total, count = all_reduce_sum([float(kl.sum()), float(len(samples))], ctx.device)
        metrics["kl/reward_penalty"] = total / max(count, 1.0)
    if cfg.adv.estimator == "rloo":
        adv = alg.rloo_advantages(rewards, n)
    else:
        adv = alg.group_baseline_advantages(rewards, n, norm_var=cfg.adv.norm_var)
    if cfg.adv.global_norm:
        s1, s2, c = all_reduce_sum([float(adv.sum()), float((adv ** 2).sum()), float(adv.numel())], ctx.device)
        mean = s1 / max(c, 1.0)
        std = max(s2 / max(c, 1.0) - mean ** 2, 0.0) ** 0.5
        adv = alg.global_normalize(adv, mean, std)
    return adv.tolist(), metrics
