"""The pure parts of a training step before the model passes: rollout metrics, reward shaping, group
selection (dynamic filtering / DAPO dynamic sampling), running reward statistics. Advantages are
train/trainer/advantages.py."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from train.algorithms.dynamic_sampling import informative_groups
from train.algorithms.moments import merge_moments
from train.algorithms.shaping import overlong_penalty
from train.parallel.distributed import DistContext
from train.parallel.collectives import all_reduce_max, all_reduce_sum
from train.workers.config import RolloutConfig
from train.workers.rollout import UNUSABLE_PROMPTS, Sample

def rollout_metrics(samples: list[Sample], n_groups: int, group_size: int, rollout: RolloutConfig,
                    ctx: DistContext, rewards: list[float] | None = None,
                    sources: Sequence[str] = (), known_criteria: set[str] | None = None) -> dict[str, float]:
    """Global (all-rank) rollout statistics, computed before any filtering. `rewards/train` is the
    environment's reward; informativeness (`dynamic_filtering_ratio`) uses `rewards` (shaped) if given.
    `sources` (the same on every rank) adds `rewards/train/<source>`, `response_length/train/<source>`
    and `env/errors/<source>` for each source that had samples this step. Samples of rows whose prompt
    fills the context were never rolled out: they count in `prompt_overflow_ratio/train` and
    `context_overflow_ratio/train` only."""
    known = set() if known_criteria is None else known_criteria
    shaped = rewards if rewards is not None else [s.reward for s in samples]
    groups = [shaped[g * group_size:(g + 1) * group_size] for g in range(n_groups)
              if samples[g * group_size].finish_reason not in UNUSABLE_PROMPTS]
    dropped = sum(len(set(grp)) <= 1 for grp in groups)
    n_groups = len(groups)
    too_long = float(sum(s.finish_reason in UNUSABLE_PROMPTS for s in samples))
    samples = [s for s in samples if s.finish_reason not in UNUSABLE_PROMPTS]
    max_turns = int(rollout.max_turns)
    per_turn = [0.0] * (2 * max_turns)  # (token sum, count) of each turn index
    for s in samples:
        for k, n in enumerate(s.turn_lengths[:max_turns]):
            per_turn[2 * k] += n
            per_turn[2 * k + 1] += 1
    values = [
        sum(s.reward for s in samples), float(len(samples)),
        float(sum(s.n_action_tokens for s in samples)),
        float(sum(s.finish_reason == "length" for s in samples)),
        float(sum(s.finish_reason == "context" for s in samples)),
        float(sum(s.n_turns for s in samples)),
        float(sum(bool(s.env_error) for s in samples)),
        float(dropped), float(n_groups),
        float(sum(len(s.ids) for s in samples)), float(sum(s.prompt_length for s in samples)),
        too_long, float(sum(any(e["type"] == "env_truncated" for e in s.events) for s in samples)),
        *tool_sums(samples),
        *per_turn,
        *per_source_sums(samples, sources, lambda s: float(s.n_action_tokens)),
        *[float(sum(bool(s.env_error) for s in samples if s.source == source)) for source in sources],
        float(len(new_criteria := criteria_of(samples) - known)),  # rubric criteria not every rank knows yet
    ]
    *values, n_new_criteria = all_reduce_sum(values, ctx.device)
    reward, count, tokens, clipped, overflow, turns, errors, dropped, n_groups, traj, prompt, too_long, truncated, \
        tool_calls, tool_errors, with_tools, *rest = values
    per_turn, by_source = rest[:2 * max_turns], rest[2 * max_turns:2 * max_turns + 3 * len(sources)]
    source_errors = rest[2 * max_turns + 3 * len(sources):]
    longest = all_reduce_max(float(max((len(s.ids) for s in samples), default=0)), ctx.device)
    every = max(count + too_long, 1.0)  # the skipped rows' samples too
    count = max(count, 1.0)
    filtering = rollout.dynamic_filtering or rollout.dynamic_sampling
    out = {
        "rewards/train": reward / count,
        "response_length/train": tokens / count,
        "length_clip_ratio/train": clipped / count,
        # samples that hit the context (rollout.max_total_length): an env's messages would not fit
        # (the episode ended before them), or the prompt alone filled it (the row was skipped)
        "context_overflow_ratio/train": (overflow + too_long) / every,
        "prompt_overflow_ratio/train": too_long / every,  # the second kind alone (data.overlong_prompts)
        "n_turns/train": turns / count,
        "env/errors": errors,
        "dynamic_filtering_ratio": dropped / max(n_groups, 1.0) if filtering else 0.0,
        # the whole conversation in tokens: prompt, every sampled turn, every tool/env message
        "trajectory_length/train": traj / count,
        "trajectory_length/train_max": longest,
        "prompt_length/train": prompt / count,
        "turn_length/train": tokens / max(turns, 1.0),  # sampled tokens per assistant turn
    }
    for source, (reward_sum, n, length_sum), n_errors in zip(sources, split_triples(by_source), source_errors):
        if n > 0:
            out[f"rewards/train/{source}"] = reward_sum / n
            out[f"response_length/train/{source}"] = length_sum / n
            out[f"env/errors/{source}"] = n_errors  # samples whose env call failed (scored env_error_reward)
    out.update(rubric_metrics(samples, sources, ctx, known, new_criteria if n_new_criteria > 0 else None))
    if max_turns > 1:
        out["tools/calls_per_sample"] = tool_calls / count
        out["tools/call_rate"] = with_tools / count  # share of samples that called a tool at least once
        out["tools/errors"] = tool_errors  # tool replies flagged `"error": true` by the environment
        out["env/truncated_ratio/train"] = truncated / count  # samples with an env reply cut to rollout.max_env_chars
        for k in range(max_turns):
            if per_turn[2 * k + 1] > 0:
                out[f"turn_length/turn{k + 1}"] = per_turn[2 * k] / per_turn[2 * k + 1]
    return out


def criteria_of(samples: list[Sample]) -> set[str]:
    return {n for s in samples for n in (getattr(s, "criteria", None) or {})}


def rubric_metrics(samples: list[Sample], sources: Sequence[str], ctx: DistContext, known: set[str],
                   new: set[str] | None) -> dict[str, float]:
    """`rubric/<criterion>`: each rubric criterion's mean over the samples it scored (train/workers/rubric.py), and
    `rubric/<criterion>/<source>` with several sources. `known` (kept by the caller across steps) holds the
    criteria every rank knows, so every rank reduces the same list; `new` is not None on every rank when some rank
    met criteria the others may not know (rollout_metrics counts them in its one all-reduce): then, and only then
    (a run's first step), the names are gathered. A run without rubrics adds no collective."""
    if new is not None:
        if ctx.world_size > 1 and torch.distributed.is_initialized():
            every: list = [None] * ctx.world_size
            torch.distributed.all_gather_object(every, sorted(new))
            new = {n for part in every for n in part}
        known.update(new)
    names = sorted(known)
    if not names:
        return {}
    keys = [(n, None) for n in names] + [(n, src) for n in names for src in sources]
    values = []
    for name, source in keys:
        scored = [s.criteria[name] for s in samples if name in (getattr(s, "criteria", None) or {})
                  and (source is None or s.source == source)]
        values += [float(sum(scored)), float(len(scored))]
    sums = all_reduce_sum(values, ctx.device)
    out = {}
    for (name, source), total, n in zip(keys, sums[0::2], sums[1::2]):
        if n > 0:
            out[f"rubric/{name}" if source is None else f"rubric/{name}/{source}"] = total / n
    return out


def tool_sums(samples: list[Sample]) -> list[float]:
    """(tool replies, tool replies flagged as errors, samples with at least one tool reply): the
    environment's messages that went into each conversation, as `RolloutWorker` records them."""
    replies = [[m for e in s.events if e["type"] == "tool" for m in e["messages"] if m.get("role") == "tool"]
               for s in samples]
    return [float(sum(map(len, replies))), float(sum(bool(m.get("error")) for r in replies for m in r)),
            float(sum(bool(r) for r in replies))]


def per_source_sums(samples: list[Sample], sources: Sequence[str],
                    extra: Callable[[Sample], float]) -> list[float]:
    """(reward sum, sample count, sum of `extra`) of each source in order, flat, for one all-reduce."""
    index = {source: i for i, source in enumerate(sources)}
    sums = [0.0] * (3 * len(sources))
    for s in samples:
        i = index.get(s.source)
        if i is not None:
            sums[3 * i] += s.reward
            sums[3 * i + 1] += 1.0
            sums[3 * i + 2] += extra(s)
    return sums


def split_triples(values: list[float]) -> list[tuple[float, float, float]]:
    return [tuple(values[i:i + 3]) for i in range(0, len(values), 3)]


def shape_rewards(samples: list[Sample], rollout: RolloutConfig) -> None:
    """Each sample's `shaped_reward` (reward + DAPO overlong penalty) and `overlong_penalty`. The
    penalty grows linearly from 0 to `rollout.overlong_penalty` over the last `rollout.overlong_buffer`
    tokens (a count, or a fraction of the limit) before the length limit, max_new_tokens x max_turns
    sampled tokens; off when the buffer is null."""
    buffer = rollout.overlong_buffer
    if not buffer:
        for s in samples:
            s.shaped_reward, s.overlong_penalty = s.reward, 0.0
        return
    limit = rollout.train_sampling_params["max_new_tokens"] * rollout.max_turns
    if isinstance(buffer, float):  # a fraction of the limit (DAPO: 4096 of 20480 = 0.2)
        buffer = max(1, round(buffer * limit))
    lengths = torch.tensor([float(s.n_action_tokens) for s in samples], dtype=torch.float64)
    pen = overlong_penalty(lengths, limit, min(buffer, limit), rollout.overlong_penalty).tolist()
    for s, p in zip(samples, pen):
        s.shaped_reward, s.overlong_penalty = s.reward + p, p


def select_groups(samples: list[Sample], group_size: int, dynamic_filtering: bool) -> list[Sample]:
    """Drop groups whose shaped rewards are all equal (no signal) before any log-prob work, and
    always the groups of rows whose prompt filled the context (nothing was sampled)."""
    if not samples:
        return []
    rewards = torch.tensor([s.shaped_reward for s in samples], dtype=torch.float64)
    keep = (informative_groups(rewards, group_size).tolist()
            if dynamic_filtering else [True] * (len(samples) // group_size))
    kept = []
    for g, ok in enumerate(keep):
        if ok and samples[g * group_size].finish_reason not in UNUSABLE_PROMPTS:
            kept += samples[g * group_size:(g + 1) * group_size]
    return kept


def mask_truncated(samples: list[Sample]) -> None:
    """Silence truncated responses (finish reason `length`) in the loss; their reward still counts in
    their group's baseline (DAPO's overlong filtering)."""
    for s in samples:
        if s.finish_reason == "length":
            s.action_mask = [0] * len(s.action_mask)


# ----------------------------------------------------------------------------------------------
# running reward statistics (PPO reward scaling for the critic)


@dataclass
class RunningMoments:
    """Count, mean and population variance of every reward seen so far (all ranks)."""
    count: float = 0.0
    mean: float = 0.0
    var: float = 0.0

    def update(self, values: list[float]) -> None:
        """Merge a step's rewards: all ranks' (the step batch's index holds them on every rank)."""
        n, s1, s2 = float(len(values)), float(sum(values)), float(sum(v * v for v in values))
        if n <= 0:
            return
        mean = s1 / n
        self.count, self.mean, self.var = merge_moments(self.count, self.mean, self.var, n, mean,
                                                        max(s2 / n - mean * mean, 0.0))

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.var = state["count"], state["mean"], state["var"]
