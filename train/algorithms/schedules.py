"""Coefficient schedules over optimizer steps."""
from __future__ import annotations

import math

ENTROPY_SCHEDULES = ("constant", "linear", "cosine")


def entropy_coef_schedule(step: int, total_steps: int, coef: float, min_coef: float, kind: str) -> float:
    """Entropy bonus coefficient at optimizer step `step` (0-based) of `total_steps`: `coef` decayed
    to the floor `min_coef` (linear or cosine), never below the floor; "constant" is `coef`."""
    if kind == "constant":
        return coef
    progress = min(1.0, max(0.0, step / max(1, total_steps)))
    if kind == "linear":
        value = coef + (min_coef - coef) * progress
    elif kind == "cosine":
        value = min_coef + (coef - min_coef) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown entropy schedule {kind!r}; valid: {', '.join(ENTROPY_SCHEDULES)}")
    return max(value, min_coef)
