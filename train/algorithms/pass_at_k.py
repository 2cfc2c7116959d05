"""pass@k: the chance that at least one of k replies passes, estimated without bias from n sampled replies of which c
passed (Chen et al., 2021). Used by the in-training evaluation (train/trainer/evaluation.py) and `python -m
train.eval`."""
from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k replies drawn without replacement from n, c of them passing,
    passes: 1 - C(n - c, k) / C(n, k), as a running product (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
