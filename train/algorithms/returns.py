"""Token rewards and what is discounted from them: GAE (PPO with a critic) and returns-to-go
(REINFORCE++), over action tokens only."""
from __future__ import annotations

import torch
from torch import Tensor

from train.algorithms.masks import bool_mask, place_on_last_action_token


def token_level_rewards(outcome: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """r_t = -kl_coef * kl_t on every action token, plus the outcome reward on the last action token.

    `outcome` [B]; `kl` [B, T] (a per-token KL estimate, e.g. k1) or None. 0 on non-action tokens.
    """
    out = place_on_last_action_token(outcome, mask)
    if kl is not None and kl_coef:
        out = out - kl_coef * torch.where(bool_mask(mask), kl.to(out.dtype), torch.zeros((), dtype=out.dtype,
                                                                                           device=out.device))
    return out


@torch.no_grad()
def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE over action tokens only: delta_t = r_t + gamma*V_next - V_t, A_t = delta_t + gamma*lam*A_next.

    "next" is the next ACTION token of the same row (V_next = A_next = 0 after the last one), so
    prompt/tool tokens between turns are skipped, not discounted. Rewards and values on non-action
    tokens are ignored; advantages and returns (A_t + V_t) are 0 there. Computed without grad.
    """
    m = bool_mask(mask)
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros(B, dtype=token_rewards.dtype, device=token_rewards.device)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        mt = m[:, t]
        adv[:, t] = torch.where(mt, a, torch.zeros_like(a))
        next_value = torch.where(mt, values[:, t], next_value)
        next_adv = torch.where(mt, a, next_adv)
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    returns = torch.where(m, adv + values, zero)
    return adv, returns


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k>=0} gamma^k r_{t_k} over the action tokens t = t_0 < t_1 < ... of the row (REINFORCE++);
    non-action tokens are skipped, not discounted, and hold 0. Equal to GAE with V = 0 and lambda = 1."""
    values = torch.zeros_like(token_rewards)
    return gae(token_rewards, values, mask, gamma, 1.0)[0]
