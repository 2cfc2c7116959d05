"""How far the policy has moved from where it started, measured on the evaluation's sampled replies
(`trainer.test_samples`): `kl_to_start/test` (and per source), the mean over action tokens of
log pi_policy(token) - log pi_start(token). On replies sampled from the policy at the training temperature
(`trainer.test_temperature` equal to the rollout's), that is the k1 estimate of KL(policy || start) per token.

The starting policy is one the run already holds: the base model of a LoRA actor (its adapters off), or the KL
reference (`actor.kl.coef` > 0) when it is the actor's own starting folder. Without either, nothing is measured
(keeping a copy of the starting weights only for this would double the actor's memory).

Cost per evaluation: one forward pass of the actor and one of the starting model over the sampled replies, in
each model's own data layout (every rank scores its share); one all-reduce. `trainer.forgetting.max_kl` gates it.
"""
from __future__ import annotations

import os

import torch

from train.models.actor import Actor, AdapterFreeReference
from train.parallel.collectives import all_reduce_sum
from train.parallel.distributed import DistContext
from train.parallel.step_batch import dispatch, exchange_index
from train.workers.rollout import Sample


def holds_start(lora: bool, kl_coef: float, distill: bool, actor_path: str, ref_path: str) -> bool:
    """Whether a run holds its starting policy: a LoRA actor's base, or the KL reference (not a distillation
    teacher) loaded from the actor's own folder. The trainer's config check and `StartDrift.of` both ask this."""
    same = os.path.realpath(ref_path) == os.path.realpath(actor_path)
    return lora or (kl_coef > 0 and not distill and same)


class StartDrift:
    def __init__(self, actor: Actor, start: Actor | AdapterFreeReference, ctx: DistContext, vision: bool) -> None:
        self.actor, self.start, self.ctx, self.vision = actor, start, ctx, vision

    @classmethod
    def of(cls, actor: Actor, ref, *, actor_path: str, ref_path: str, distill: bool, ctx: DistContext,
           vision: bool) -> "StartDrift | None":
        """The measure for this run's models, or None when it holds no starting policy."""
        if not holds_start(actor.lora.enabled, actor.cfg.kl.coef, distill, actor_path, ref_path):
            return None
        if actor.lora.enabled:
            return cls(actor, ref if isinstance(ref, AdapterFreeReference) else AdapterFreeReference(actor), ctx,
                       vision)
        return cls(actor, ref, ctx, vision)  # the KL reference, loaded from the actor's start

    def __call__(self, samples: list[Sample], sources: list[str]) -> dict[str, float]:
        """`kl_to_start/test` over every rank's `samples`, and `kl_to_start/test/<source>` for a mixture's sources
        (collective: every rank calls it)."""
        device = self.ctx.device
        names = {name: i for i, name in enumerate(sources)}
        index = exchange_index([len(s.ids) for s in samples], list(range(len(samples))), [0.0] * len(samples),
                               device, routes=[names.get(s.source, 0) for s in samples])
        if index.size == 0:
            return {}
        width = max(len(sources), 1)
        sums = [0.0] * (3 * width)  # per source: sum of log pi_policy, of log pi_start, action tokens
        for model, offset in ((self.actor, 0), (self.start, 1)):
            batch = dispatch(index, [s.ids for s in samples], [s.action_mask for s in samples],
                             [s.sampler_logprobs for s in samples], model.layout, 1, device,
                             images=[s.images for s in samples] if self.vision else None)
            with torch.no_grad():
                logps = model.compute_logprobs(batch)
            if not batch.is_leader:  # the other ranks of its sp x tp group hold the same samples
                continue
            for g, logp, mask in zip(batch.members, logps, batch.mask):
                source = index.route[g]
                sums[3 * source + offset] += float((logp.double() * mask.double()).sum())
                if offset == 0:
                    sums[3 * source + 2] += float(mask.sum())
        sums = all_reduce_sum(sums, device)
        total = [sum(sums[i::3]) for i in range(3)]
        out = {"kl_to_start/test": (total[0] - total[1]) / max(total[2], 1.0)}
        for name, i in names.items():
            if len(sources) > 1 and sums[3 * i + 2] > 0:
                out[f"kl_to_start/test/{name}"] = (sums[3 * i] - sums[3 * i + 1]) / sums[3 * i + 2]
        return out
