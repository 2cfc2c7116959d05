"""Tinker's built-in `forward_backward` losses, computed with this trainer's own loss functions.

Tinker defines each loss per datum, summed over its tokens (tinker-docs.thinkingmachines.ai/tinker/losses):

    cross_entropy        -(logp * weights).sum()                          inputs: target_tokens, weights
    importance_sampling  -(exp(logp - q) * A).sum()                       target_tokens, logprobs (q), advantages
    ppo                  -min(r * A, clip(r, low, high) * A).sum(), r = exp(logp - q)    + clip thresholds
    cispo                -(sg(clip(r, low, high)) * logp * A).sum()
    dro                  -(logp * A - beta / 2 * (logp - q)^2).sum()                loss_fn_config["beta"]
    gspo                 GSPO-token: every token carries the sequence ratio exp(mean over sequence_ratio_mask of
                         (logp - q)) with its own log-prob's gradient, then ppo's min/clip, summed

ppo, cispo and dro are `train.algorithms.policy_loss`'s ppo_clip_loss, cispo_loss and dro_loss with `sum`
aggregation over every position (the functions the GRPO trainer's step calls; their log-ratios are clamped to
[-20, 20] before exp, a guard Tinker does not document). gspo is ppo_clip_loss against shifted sampler
log-probs (see `datum_loss`): the trainer's own gspo_loss counts only the masked tokens, Tinker counts all.
Tinker's thresholds are the ratio's bounds
(`clip_low_threshold=0.8`); ours are distances from 1, converted here. A threshold may also come per token in
`loss_fn_inputs` (the SDK's Datum lists clip_low_threshold / clip_high_threshold as float32 inputs).
Defaults: ppo 0.8 / 1.2 (Tinker's "fixed to 0.2"), cispo 0.0 / 4.0 (Tinker's one-sided default), gspo
1 - 3e-4 / 1 + 4e-4 (the GSPO paper's ranges; Tinker's docs give no default).
Not built in: `stable_reinforce` (needs the sampler's recorded stability info) and server-side `custom`
losses; the SDK's client-side `forward_backward_custom` works (it sends cross_entropy with weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from train.algorithms.policy_loss import LossSettings, cispo_loss, dro_loss, ppo_clip_loss
from train.tinker_service.errors import ClientError


@dataclass(frozen=True)
class LossSpec:
    inputs: tuple[str, ...]  # required loss_fn_inputs besides target_tokens
    optional: tuple[str, ...] = ()
    clip: tuple[float, float] | None = None  # default (low, high) ratio thresholds
    config: tuple[str, ...] = ()  # loss_fn_config keys it reads


_CLIP = ("clip_low_threshold", "clip_high_threshold")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec((), optional=("weights",)),
    "importance_sampling": LossSpec(("logprobs", "advantages")),
    "ppo": LossSpec(("logprobs", "advantages"), optional=_CLIP, clip=(0.8, 1.2), config=_CLIP),
    "cispo": LossSpec(("logprobs", "advantages"), optional=_CLIP, clip=(0.0, 4.0), config=_CLIP),
    "gspo": LossSpec(("logprobs", "advantages"), optional=(*_CLIP, "sequence_ratio_mask"), clip=(1 - 3e-4, 1 + 4e-4),
                     config=_CLIP),
    "dro": LossSpec(("logprobs", "advantages"), config=("beta",)),
}
UNSUPPORTED = {
    "stable_reinforce": "it needs the sampler's recorded stability info (record_stability_info), which this "
                        "service's sampler does not record",
    "custom": "server-side custom losses (ServiceClient.create_custom_loss) are not run here; "
              "forward_backward_custom with a Python function runs client-side and works",
}


def check_request(loss_fn: str, config: dict[str, float | str]) -> LossSpec:
    """The loss's spec, or a ClientError naming what is wrong with `loss_fn` / `loss_fn_config`."""
    if loss_fn in UNSUPPORTED:
        raise ClientError(f"loss_fn={loss_fn!r} is not supported by this service: {UNSUPPORTED[loss_fn]}")
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise ClientError(f"unknown loss_fn {loss_fn!r}; built in: {', '.join(LOSSES)}")
    unknown = [k for k in config if k not in spec.config]
    if unknown:
        raise ClientError(f"loss_fn_config keys {unknown} mean nothing to {loss_fn!r} "
                             f"(it reads: {', '.join(spec.config) or 'none'})")
    for key, value in config.items():
        if isinstance(value, str):
            raise ClientError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
    if loss_fn == "dro" and "beta" not in config:
        raise ClientError("loss_fn='dro' needs loss_fn_config={'beta': ...} (e.g. 0.05)")
    return spec


def cross_entropy_terms(logp: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    """cross_entropy's per-token loss -logp * weights (weights default to 1): its `elementwise_loss` output."""
    weights = inputs.get("weights")
    return -logp * (weights if weights is not None else 1.0)


def datum_loss(loss_fn: str, logp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """One datum's summed loss. `logp` [N]: log p(target_tokens[i] | model_input[:i+1]) under the model
    being trained (float32, with grad); `inputs`: the datum's loss_fn_inputs as float tensors [N]."""
    if loss_fn == "cross_entropy":
        return cross_entropy_terms(logp, inputs).sum()
    q, adv = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -(torch.exp(logp - q) * adv).sum()
    row = lambda t: t.reshape(1, -1)  # noqa: E731 - the policy losses take [B, T]
    everywhere = torch.ones_like(row(logp), dtype=torch.bool)
    if loss_fn == "dro":
        settings = LossSettings(clip_low=0.0, clip_high=0.0, dro_beta=float(config["beta"]))
        return dro_loss(row(logp), row(q), row(adv), everywhere, settings)[0].sum()
    low, high = LOSSES[loss_fn].clip  # type: ignore[misc]
    low = inputs.get(_CLIP[0], config.get(_CLIP[0], low))
    high = inputs.get(_CLIP[1], config.get(_CLIP[1], high))
    if isinstance(low, Tensor) or isinstance(high, Tensor):  # torch.clamp takes two tensors or two numbers
        low, high = (row(torch.as_tensor(v, dtype=logp.dtype).expand_as(logp)) for v in (low, high))
    lo, hi = 1.0 - low, high - 1.0
    settings = LossSettings(clip_low=lo, clip_high=hi)  # type: ignore[arg-type] - per-token tensors broadcast
    if loss_fn == "ppo":
        return ppo_clip_loss(row(logp), row(q), row(adv), everywhere, settings)[0].sum()
    if loss_fn == "cispo":
        return cispo_loss(row(logp), row(q), row(adv), everywhere, settings)[0].sum()
    # gspo: the sequence's mean log-ratio over sequence_ratio_mask, carried by every token with its own
    # log-prob's gradient, is ppo's ratio against the shifted sampler log-probs sg(logp) - mean log-ratio.
    ratio_mask = inputs.get("sequence_ratio_mask")
    inside = torch.ones_like(logp, dtype=torch.bool) if ratio_mask is None else ratio_mask != 0
    if not inside.any():
        raise ClientError("loss_fn='gspo': sequence_ratio_mask marks no token of a datum")
    seq_log_ratio = (logp.detach() - q)[inside].mean()
    shifted = logp.detach() - seq_log_ratio
    return ppo_clip_loss(row(logp), row(shifted), row(adv), everywhere, settings)[0].sum()
