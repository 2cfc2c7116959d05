"""Logits -> per-token log-probs of the labels and entropy."""
from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v * z_v over the last dim ([B, T, V] -> [B, T]); -inf logits allowed."""
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    z = torch.where(p > 0, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))  # 0 * -inf -> 0
    return lse - (p * z).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(z / temperature)[label] = z_label / temperature - logsumexp(z / temperature) ([B, T, V] -> [B, T]).

    Gathers the label logit and takes a logsumexp instead of materialising a full log_softmax.
    `labels` must be valid vocabulary ids everywhere (mask the result, not the labels).
    """
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
