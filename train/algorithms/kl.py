"""KL estimators (Schulman, "Approximating KL divergence"), samples drawn from the policy, registered
by name: `actor.kl.type` (in the loss) and `actor.kl.reward_estimator` (in the reward) choose one."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from train.algorithms.ratios import LOG_RATIO_CLAMP
from train.algorithms.registry import Registry

# d = logp - ref_logp -> per-token estimate. Listed names are the config's; the others are aliases.
KL_ESTIMATORS: Registry[Callable[[Tensor], Tensor]] = Registry("KL estimator", "actor.kl.type")


@KL_ESTIMATORS.register("k1")
@KL_ESTIMATORS.register("kl", listed=False)
def k1(d: Tensor) -> Tensor:
    """d: unbiased, can be negative."""
    return d


@KL_ESTIMATORS.register("k2")
@KL_ESTIMATORS.register("mse", listed=False)
def k2(d: Tensor) -> Tensor:
    """d^2 / 2."""
    return 0.5 * d**2


@KL_ESTIMATORS.register("abs", listed=False)
def abs_kl(d: Tensor) -> Tensor:
    """|d|."""
    return d.abs()


@KL_ESTIMATORS.register("k3")
def k3(d: Tensor) -> Tensor:
    """exp(-d) + d - 1: unbiased and >= 0."""
    return torch.exp(-d) + d - 1.0


@KL_ESTIMATORS.register("low_var_kl")
def low_var_kl(d: Tensor) -> Tensor:
    """k3 clamped to [-10, 10] (k3 >= 0, so in effect capped at 10); d is clamped to [-20, 20] first,
    which leaves the clamped value unchanged and keeps exp() finite."""
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) with d = logp - ref_logp: k1 = d, k2 = d^2/2, k3 = exp(-d) + d - 1.

    kinds: "k1" (alias "kl"), "k2" (alias "mse"), "k3", "abs" = |d|, and "low_var_kl" (see
    `low_var_kl`). Gradients flow into both arguments.
    """
    estimator = KL_ESTIMATORS.get(kind)
    return estimator(logp - ref_logp)
