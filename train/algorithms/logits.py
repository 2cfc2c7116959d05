"""Logits -> per-token log-probs of the labels and entropy."""
from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v * z_v over the last dim ([B, T, V] -> [B, T]); -inf logits allowed."""
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    z = torch.where(p > 0, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))  # 0 * -inf -> 0
    # without a graph (the metric) p * z goes into p's storage: one [tokens, vocab] float32 tensor fewer
    pz = p * z if torch.is_grad_enabled() and logits.requires_grad else p.mul_(z)
    return lse - pz.sum(dim=-1)


UNSAMPLED_LOGIT = -1e30


def mask_unsampled(logits: Tensor, ids: Tensor | None) -> Tensor:
    """float32 `logits` [..., vocab] with the columns `ids` at UNSAMPLED_LOGIT (probability 0 after a softmax at
    any temperature down to 1e-7; finite, so entropies stay finite); the logits themselves when `ids` is None.
    A vision-language model's image placeholder tokens (train/models/vlm.py)."""
    if ids is None:
        return logits
    return logits.index_fill(-1, ids, UNSAMPLED_LOGIT)


def head_logprobs_entropy(logits: Tensor, labels: Tensor, temperature: float, *, unsampled: Tensor | None = None,
                          with_entropy: bool = True, entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """The actor's plain head: log-probs of `labels` and the entropy from the lm_head's `logits` [tokens, vocab]
    in the model's dtype, in float32 at `temperature`, with the `unsampled` columns masked. The entropy has a graph
    only with `entropy_grad` (an entropy bonus); otherwise it is a metric. The float32 logits are divided once and
    shared; the backward holds at most 16 bytes per token and vocabulary entry, 21 with the entropy's graph
    (memory_plan.head_bytes, measured in tests/integration/test_fused_logprobs.py)."""
    z = mask_unsampled(logits.float(), unsampled)
    if temperature != 1.0:
        z = z / temperature  # the unscaled copy is freed
    logp = logprobs_from_logits(z, labels)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        return logp, entropy_from_logits(z)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(z / temperature)[label] = z_label / temperature - logsumexp(z / temperature) ([B, T, V] -> [B, T]).

    Gathers the label logit and takes a logsumexp instead of materialising a full log_softmax.
    `labels` must be valid vocabulary ids everywhere (mask the result, not the labels).
    """
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
