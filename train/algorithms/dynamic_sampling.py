"""DAPO dynamic sampling: which groups carry a signal, and how many each rank keeps."""
from __future__ import annotations

from torch import Tensor


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[n_groups] bool: True where the group's rewards are not all equal (it carries a learning signal).
    Samples of one group are contiguous: rewards [B] is read as [B / group_size, group_size]."""
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}")
    r = rewards.view(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def split_quota(counts: list[int], target: int) -> list[int]:
    """How many of its `counts[r]` items each rank keeps so that `min(target, sum)` are kept in all,
    as evenly as the counts allow (max-min fair: every rank keeps min(count, L) or L + 1, the extra
    ones going to the lowest ranks). Deterministic: every rank computes the same answer from the same
    all-reduced counts."""
    total = min(target, sum(counts))
    level = 0  # the largest L with sum(min(c, L)) <= total
    while sum(min(c, level + 1) for c in counts) <= total and level < max(counts, default=0):
        level += 1
    keep = [min(c, level) for c in counts]
    left = total - sum(keep)
    for r, c in enumerate(counts):
        if left and c > level:
            keep[r] += 1
            left -= 1
    return keep
