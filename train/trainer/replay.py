"""Prioritized replay (`data.replay.*`): each rank keeps its informative groups of past steps and mixes some
of them into later steps' batches.

A group is kept whole (its advantages come from its own rewards, as when it was new), with its tokens, its
sampler log-probs and the step that rolled it out. Its priority says how much it is worth seeing again:

- `success`: the group had successes, and rarely (priority 1 - pass rate): the prompts the policy solves only
  now and then, whose few successful samples a step otherwise sees once. A pass is a reward (or the rubric
  criterion `data.replay.criterion`) >= `data.curriculum.pass_threshold`.
- `advantage`: mean |reward - the group's mean|: the groups the loss weighs most.
- `uniform`: every informative group alike.

A step draws round(share x its prompts) groups without replacement, with probability proportional to
priority ** alpha, among the groups at most `max_age` steps old. Adaptive replay: while the forgetting gate sees a
source's held-out metric fallen (`trainer.forgetting.watch` on `rewards/test/<source>`), that source's groups
weigh `favour_failing` times more (the old task's training rows in a mixture; never the held-out rows themselves).
The samples are off-policy by their age: the loss corrects each token with the truncated importance weight against
its sampler log-prob (`actor.tis_cap`, on by default with replay). The draw's randomness is a function of (seed, step, rank), so a resumed run draws
what the uninterrupted one would; the buffer itself is in each rank's checkpoint state.

Memory: at most `capacity` groups of `responses_per_prompt` samples per rank, on the host, their per-token fields
packed (25 bytes a token: 64 groups of 8 samples of 16K tokens take ~210 MB), whatever the number of ranks; no
collective beyond the step's metrics' one all-reduce.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, replace

import torch

from train.datasets.config import ReplayConfig
from train.workers.rollout import Sample


# The per-token fields of a kept sample, as flat typed arrays (ids, mask, sampler log-probs, versions: 8 + 1 + 8 + 8
# bytes a token, against ~120 in Python lists of int and float objects); back to lists when the group is drawn.
PACKED = {"ids": "q", "action_mask": "b", "sampler_logprobs": "d", "token_versions": "q"}


def pack(s: Sample) -> Sample:
    return replace(s, **{name: array(code, getattr(s, name)) for name, code in PACKED.items()})


def unpack(s: Sample) -> Sample:
    return replace(s, **{name: list(getattr(s, name)) for name in PACKED})


@dataclass
class ReplayGroup:
    """One group in the buffer, its samples packed (`pack`)."""
    samples: list[Sample]
    step: int  # the step whose rollout made it
    priority: float
    uses: int = 0


class ReplayBuffer:
    """This rank's past groups, bounded by `capacity`, and the step's prioritized draw."""

    def __init__(self, cfg: ReplayConfig, group_size: int, pass_threshold: float, prompts_per_rank: int,
                 seed: int, rank: int) -> None:
        self.cfg, self.n, self.threshold = cfg, group_size, pass_threshold
        self.per_step = max(1, round(cfg.share * prompts_per_rank))
        self.seed, self.rank = seed, rank
        self.groups: list[ReplayGroup] = []
        # data sources whose held-out metric the forgetting gate saw fall: their groups' draws weigh `favour_failing`
        # times more until an evaluation passes (adaptive replay; train/trainer/forgetting.py)
        self.favoured: set[str] = set()

    # -- priorities ------------------------------------------------------------------------
    def score(self, s: Sample) -> float:
        """What decides a pass: the rubric criterion named by data.replay.criterion, else the reward."""
        name = self.cfg.criterion
        return s.reward if name is None else s.criteria.get(name, 0.0)

    def priority(self, group: list[Sample]) -> float:
        """How much the group is worth replaying (0: not kept)."""
        kind = self.cfg.priority
        if kind == "success":
            rate = sum(self.score(s) >= self.threshold for s in group) / len(group)
            return 1.0 - rate if rate > 0 else 0.0  # a group that always passes is as useless as one that never does
        rewards = [s.shaped_reward if s.shaped_reward is not None else s.reward for s in group]
        mean = sum(rewards) / len(rewards)
        spread = sum(abs(r - mean) for r in rewards) / len(rewards)
        if kind == "advantage":
            return spread
        return 1.0 if spread > 0 else 0.0  # uniform over the informative groups

    # -- the step's calls ------------------------------------------------------------------
    def mix(self, step: int, kept: list[Sample]) -> tuple[list[Sample], list[ReplayGroup]]:
        """This step's samples: the fresh `kept` groups, then the groups drawn from the buffer (from earlier steps
        only); the fresh groups join the buffer after the draw. Returns (the samples, the groups replayed)."""
        self.groups = [g for g in self.groups if step - g.step <= self.cfg.max_age]
        drawn = self.draw(step)
        for g in drawn:
            g.uses += 1
        self.groups = [g for g in self.groups if g.uses < self.cfg.max_uses]
        self.add(step, kept)
        return kept + [unpack(s) for g in drawn for s in g.samples], drawn

    def draw(self, step: int) -> list[ReplayGroup]:
        """Up to `per_step` groups without replacement, proportional to priority ** alpha."""
        k = min(self.per_step, len(self.groups))
        if k == 0:
            return []
        boost = [self.cfg.favour_failing if g.samples[0].source in self.favoured else 1.0 for g in self.groups]
        weights = torch.tensor([g.priority for g in self.groups], dtype=torch.float64) ** self.cfg.alpha
        weights = weights * torch.tensor(boost, dtype=torch.float64)
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 10_007 + self.rank)
        picks = torch.multinomial(weights, k, replacement=False, generator=generator).tolist()
        return [self.groups[i] for i in picks]

    def add(self, step: int, kept: list[Sample]) -> None:
        """Keep the step's informative groups that have a priority; past capacity, the lowest priorities (the
        oldest among equals) leave."""
        for g in range(len(kept) // self.n):
            group = kept[g * self.n:(g + 1) * self.n]
            priority = self.priority(group)
            if priority > 0:
                self.groups.append(ReplayGroup([pack(s) for s in group], step, priority))
        if len(self.groups) > self.cfg.capacity:
            order = sorted(range(len(self.groups)), key=lambda i: (self.groups[i].priority, self.groups[i].step, i))
            dropped = set(order[:len(self.groups) - self.cfg.capacity])
            self.groups = [g for i, g in enumerate(self.groups) if i not in dropped]

    def favour(self, sources: list[str]) -> None:
        """Adaptive replay: the forgetting gate's failing sources (none once an evaluation passes)."""
        self.favoured = set(sources)

    def local_sums(self, step: int, drawn: list[ReplayGroup]) -> list[float]:
        """This rank's (groups replayed, their samples' reward sum, their age sum, groups held, groups replayed
        from favoured sources) for the metrics."""
        samples = [s for g in drawn for s in g.samples]
        return [float(len(drawn)), sum(s.reward for s in samples), float(sum(step - g.step for g in drawn)),
                float(len(self.groups)), float(sum(g.samples[0].source in self.favoured for g in drawn))]

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"groups": [(g.samples, g.step, g.priority, g.uses) for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.groups = [ReplayGroup(samples, step, priority, uses) for samples, step, priority, uses in state["groups"]]
