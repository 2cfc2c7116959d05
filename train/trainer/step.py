"""The pure parts of a training step: rollout metrics, reward shaping, group selection (dynamic
filtering / DAPO dynamic sampling), advantages for every estimator, running reward statistics."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from train.utils import algorithms as alg
from train.utils.distributed import DistContext, all_reduce_max, all_reduce_sum
from train.workers.rollout import Sample

GROUP_ESTIMATORS = ("reinforce", "rloo")  # one advantage per sequence
TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")  # one advantage per action token


@dataclass
class StepInputs:
    samples: list[Sample]  # kept samples; each kept group is complete and contiguous
    group_size: int
    rewards: list[float] | None = None  # shaped rewards (overlong penalty); default: each sample's reward

    def __post_init__(self) -> None:
        if self.rewards is None:
            self.rewards = [s.reward for s in self.samples]


@dataclass
class Advantages:
    advantages: list[float] | list[torch.Tensor]  # per sequence, or per token ([len-1] tensors)
    returns: list[torch.Tensor] | None = None  # critic targets ([len-1] tensors), GAE only
    metrics: dict[str, float] = field(default_factory=dict)


def rollout_metrics(samples: list[Sample], n_groups: int, group_size: int, cfg: DictConfig,
                    ctx: DistContext, rewards: list[float] | None = None) -> dict[str, float]:
    """Global (all-rank) rollout statistics, computed before any filtering. `rewards/train` is the
    environment's reward; informativeness (`dynamic_filtering_ratio`) uses `rewards` (shaped) if given."""
    shaped = rewards if rewards is not None else [s.reward for s in samples]
    groups = [shaped[g * group_size:(g + 1) * group_size] for g in range(n_groups)]
    dropped = sum(len(set(grp)) <= 1 for grp in groups)
    max_turns = int(cfg.rollout.max_turns)
    per_turn = [0.0] * (2 * max_turns)  # (token sum, count) of each turn index
    for s in samples:
        for k, n in enumerate(s.turn_lengths[:max_turns]):
            per_turn[2 * k] += n
            per_turn[2 * k + 1] += 1
    values = [
        sum(s.reward for s in samples), float(len(samples)),
        float(sum(s.n_action_tokens for s in samples)),
        float(sum(s.finish_reason == "length" for s in samples)),
        float(sum(s.n_turns for s in samples)),
        float(sum(bool(s.env_error) for s in samples)),
        float(dropped), float(n_groups),
        float(sum(len(s.ids) for s in samples)), float(sum(s.prompt_length for s in samples)),
        *per_turn,
    ]
    reward, count, tokens, clipped, turns, errors, dropped, n_groups, traj, prompt, *per_turn = \
        all_reduce_sum(values, ctx.device)
    longest = all_reduce_max(float(max((len(s.ids) for s in samples), default=0)), ctx.device)
    count = max(count, 1.0)
    filtering = cfg.rollout.dynamic_filtering or cfg.rollout.get("dynamic_sampling", False)
    out = {
        "rewards/train": reward / count,
        "response_length/train": tokens / count,
        "length_clip_ratio/train": clipped / count,
        "n_turns/train": turns / count,
        "env/errors": errors,
        "dynamic_filtering_ratio": dropped / max(n_groups, 1.0) if filtering else 0.0,
        # the whole conversation in tokens: prompt, every sampled turn, every tool/env message
        "trajectory_length/train": traj / count,
        "trajectory_length/train_max": longest,
        "prompt_length/train": prompt / count,
        "turn_length/train": tokens / max(turns, 1.0),  # sampled tokens per assistant turn
    }
    if max_turns > 1:
        for k in range(max_turns):
            if per_turn[2 * k + 1] > 0:
                out[f"turn_length/turn{k + 1}"] = per_turn[2 * k] / per_turn[2 * k + 1]
    return out


def shaped_rewards(samples: list[Sample], cfg: DictConfig) -> tuple[list[float], list[float]]:
    """(rewards + DAPO overlong penalty, penalties). The penalty grows linearly from 0 to
    `rollout.overlong_penalty` over the last `rollout.overlong_buffer` tokens (a count, or a fraction
    of the limit) before the length limit, max_new_tokens x max_turns sampled tokens; off when the
    buffer is null."""
    buffer = cfg.rollout.get("overlong_buffer")
    if not buffer:
        return [s.reward for s in samples], [0.0] * len(samples)
    limit = cfg.rollout.train_sampling_params.max_new_tokens * cfg.rollout.max_turns
    if isinstance(buffer, float):  # a fraction of the limit (DAPO: 4096 of 20480 = 0.2)
        buffer = max(1, round(buffer * limit))
    lengths = torch.tensor([float(s.n_action_tokens) for s in samples], dtype=torch.float64)
    pen = alg.overlong_penalty(lengths, limit, min(buffer, limit), cfg.rollout.get("overlong_penalty", 1.0)).tolist()
    return [s.reward + p for s, p in zip(samples, pen)], pen


def select_groups(samples: list[Sample], rewards: list[float], group_size: int, dynamic_filtering: bool
                  ) -> tuple[list[Sample], list[float]]:
    """Drop groups whose (shaped) rewards are all equal (no signal) before any log-prob work."""
    if not samples:
        return [], []
    keep = (alg.informative_groups(torch.tensor(rewards, dtype=torch.float64), group_size).tolist()
            if dynamic_filtering else [True] * (len(samples) // group_size))
    kept, kept_r = [], []
    for g, ok in enumerate(keep):
        if ok:
            kept += samples[g * group_size:(g + 1) * group_size]
            kept_r += rewards[g * group_size:(g + 1) * group_size]
    return kept, kept_r


def mask_truncated(samples: list[Sample]) -> None:
    """Silence truncated responses (finish reason `length`) in the loss; their reward still counts in
    their group's baseline (DAPO's overlong filtering)."""
    for s in samples:
        if s.finish_reason == "length":
            s.action_mask = [0] * len(s.action_mask)


def filter_groups(samples: list[Sample], group_size: int, dynamic_filtering: bool,
                  mask_truncated_: bool) -> list[Sample]:
    """select_groups on the samples' own rewards, then optional truncation masking."""
    kept, _ = select_groups(samples, [s.reward for s in samples], group_size, dynamic_filtering)
    if mask_truncated_:
        mask_truncated(kept)
    return kept


# ----------------------------------------------------------------------------------------------
# running reward statistics (PPO reward scaling for the critic)


@dataclass
class RunningMoments:
    """Count, mean and population variance of every reward seen so far (all ranks)."""
    count: float = 0.0
    mean: float = 0.0
    var: float = 0.0

    def update(self, values: list[float], ctx: DistContext) -> None:
        n, s1, s2 = all_reduce_sum([float(len(values)), float(sum(values)), float(sum(v * v for v in values))],
                                   ctx.device)
        if n <= 0:
            return
        mean = s1 / n
        self.count, self.mean, self.var = alg.merge_moments(self.count, self.mean, self.var, n, mean,
                                                            max(s2 / n - mean * mean, 0.0))

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.var = state["count"], state["mean"], state["var"]


# ----------------------------------------------------------------------------------------------
# advantages


def pad_token_values(values: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-sample [len-1] tensors -> [B, width] float64, zero padded."""
    out = torch.zeros(len(values), width, dtype=torch.float64)
    for i, v in enumerate(values):
        out[i, : v.numel()] = v.double()
    return out


def token_masks(samples: list[Sample]) -> torch.Tensor:
    """[B, T] bool action masks aligned with per-token tensors (position t is token t+1)."""
    width = max([len(s.ids) - 1 for s in samples] + [1])
    out = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, s in enumerate(samples):
        out[i, : len(s.action_mask) - 1] = torch.tensor(s.action_mask[1:], dtype=torch.bool)
    return out


def global_token_moments(x: torch.Tensor, mask: torch.Tensor, ctx: DistContext) -> tuple[float, float]:
    """Mean and Bessel-corrected variance of x over the action tokens of every rank."""
    return alg.mean_var_from_sums(*all_reduce_sum(list(alg.masked_sums(x, mask)), ctx.device))


def _unpad(x: torch.Tensor, samples: list[Sample]) -> list[torch.Tensor]:
    return [x[i, : len(s.ids) - 1].float().clone() for i, s in enumerate(samples)]


def compute_advantages(inputs: StepInputs, cfg: DictConfig, ctx: DistContext,
                       ref_logp: list[torch.Tensor] | None, policy_logp: list[torch.Tensor] | None = None,
                       values: list[torch.Tensor] | None = None, reward_scale: float = 1.0) -> Advantages:
    """Advantages of `adv.estimator` (float64 throughout):

    - reinforce / rloo: one value per sequence (group mean baseline, optional std; leave-one-out);
      with `adv.global_norm`, one baseline (and std) for the whole batch of all ranks instead (rloo: leave
      one out of the batch); `adv.batch_whiten` whitens the per-group advantages by the batch's mean
      and std. Stds are Bessel-corrected, as the peers'. KL in the reward is summed over
      the sequence: r - coef * sum_t KL_t.
    - reinforce_pp(_baseline): token rewards (-coef * KL_t on every action token, the outcome (minus the
      group mean for _baseline) on the last), discounted returns-to-go over action tokens with
      `adv.gamma`, normalised by the all-rank token mean/std (REINFORCE++).
    - gae: the same token rewards times `reward_scale`, GAE(`adv.gamma`, `adv.lamda`) over action
      tokens with the critic's `values`; returns A + V are the critic's targets; advantages are
      whitened over all ranks' action tokens if `adv.whiten`.
    The policy's log-probs for KL in the reward are `policy_logp` (trainer) or else the sampler's.
    """
    samples, n = inputs.samples, inputs.group_size
    rewards = torch.tensor(inputs.rewards, dtype=torch.float64)
    metrics: dict[str, float] = {}
    mask = token_masks(samples)
    width = mask.shape[1]
    kl_cfg = cfg.actor.kl
    kl_in_reward = ref_logp is not None and kl_cfg.reward_estimator is not None and kl_cfg.coef > 0
    kl_tok = None
    if ref_logp is not None:
        pol = policy_logp or [torch.tensor(s.sampler_logprobs[1:], dtype=torch.float64) for s in samples]
        kind = kl_cfg.reward_estimator if kl_in_reward else kl_cfg.type
        kl_tok = torch.where(mask, alg.kl_estimate(pad_token_values(pol, width), pad_token_values(ref_logp, width),
                                                   kind), torch.zeros((), dtype=torch.float64))
        total, count, tokens = all_reduce_sum([float(kl_tok.sum()), float(len(samples)), float(mask.sum())],
                                              ctx.device)
        metrics[f"kl/{kind}"] = total / max(tokens, 1.0)  # per action token, policy vs reference
        if kl_in_reward:
            metrics["kl/reward_penalty"] = total / max(count, 1.0)  # per sequence, before the coefficient
    estimator = cfg.adv.estimator
    gamma = float(cfg.adv.gamma)

    if estimator in GROUP_ESTIMATORS:
        if kl_in_reward:
            rewards = rewards - kl_cfg.coef * kl_tok.sum(dim=1)
        ones = torch.ones_like(rewards, dtype=torch.bool)
        if cfg.adv.global_norm:  # one baseline shared by the whole batch (all ranks), not per prompt
            count, total, squares = all_reduce_sum(list(alg.masked_sums(rewards, ones)), ctx.device)
            if estimator == "rloo":
                adv = alg.shared_rloo_advantages(rewards, total, count)
            else:
                mean, var = alg.mean_var_from_sums(count, total, squares)
                adv = alg.shared_baseline_advantages(rewards, mean, math.sqrt(var) if cfg.adv.norm_var else None)
        elif estimator == "rloo":
            adv = alg.rloo_advantages(rewards, n)
        else:
            adv = alg.group_baseline_advantages(rewards, n, norm_var=cfg.adv.norm_var)
        if cfg.adv.get("batch_whiten"):  # per-group advantages, then whitened by the batch's moments
            mean, var = alg.mean_var_from_sums(*all_reduce_sum(list(alg.masked_sums(adv, ones)), ctx.device))
            adv = alg.global_normalize(adv, mean, math.sqrt(var))
        return Advantages(adv.tolist(), None, metrics)

    kl = kl_tok if kl_in_reward else None
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        outcome = alg.group_baseline_advantages(rewards, n, norm_var=False) if estimator.endswith("baseline") \
            else rewards
        token_r = alg.token_level_rewards(outcome, mask, kl, kl_cfg.coef)
        ret = alg.discounted_returns(token_r, mask, gamma)
        mean, var = global_token_moments(ret, mask, ctx)
        adv = torch.where(mask, alg.global_normalize(ret, mean, math.sqrt(var)), torch.zeros((), dtype=ret.dtype))
        return Advantages(_unpad(adv, samples), None, metrics)

    if estimator != "gae":
        raise ValueError(f"unknown adv.estimator {estimator!r}")
    token_r = alg.token_level_rewards(rewards, mask, kl, kl_cfg.coef) * reward_scale
    v = pad_token_values(values, width)
    adv, ret = alg.gae(token_r, v, mask, gamma, float(cfg.adv.lamda))
    e = ret - v
    sel_r, sel_e = ret[mask], e[mask]
    n_tok, sr, sr2, se, se2 = all_reduce_sum([float(mask.sum()), float(sel_r.sum()), float((sel_r ** 2).sum()),
                                              float(sel_e.sum()), float((sel_e ** 2).sum())], ctx.device)
    ev = alg.explained_variance_from_moments(n_tok, sr, sr2, se, se2)
    if math.isfinite(ev):  # undefined when every return is equal
        metrics["critic/explained_variance"] = ev
    metrics["critic/returns"] = sr / max(n_tok, 1.0)
    metrics["critic/reward_scale"] = reward_scale
    if cfg.adv.whiten:
        mean, var = global_token_moments(adv, mask, ctx)
        adv = torch.where(mask, (adv - mean) / math.sqrt(var + 1e-8), torch.zeros((), dtype=adv.dtype))
    return Advantages(_unpad(adv, samples), _unpad(ret, samples), metrics)
