"""The critic's clipped value loss per token."""
from __future__ import annotations

import torch
from torch import Tensor

from train.algorithms.masks import bool_mask, masked_mean


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -c, c).

    With clip None it is 0.5 * (V - R)^2. 0 on non-action tokens. stats (detached, over action
    tokens): clip_fraction (share of tokens where the clipped term is the larger, i.e. the gradient
    is cut), values / returns means.
    """
    m = bool_mask(mask)
    unclipped = (values - returns) ** 2
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped, clipped)
        cut = clipped > unclipped
    else:
        loss = 0.5 * unclipped
        cut = torch.zeros_like(m)
    token_loss = torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean(cut.to(values.dtype), m),
            "values": masked_mean(values.detach(), m),
            "returns": masked_mean(returns, m),
        }
    return token_loss, stats
