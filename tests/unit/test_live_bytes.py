"""train/utils/live_bytes.py: what the memory plan's CPU checks measure with."""
from __future__ import annotations

import torch

from train.utils.live_bytes import LiveBytes


def test_it_counts_what_ops_allocate_until_it_is_freed_and_not_views_or_inputs():
    given = torch.ones(1000)  # made before: not counted, nor its views or in-place updates
    with LiveBytes() as held:
        a = torch.zeros(256, 1024)  # 1 MiB
        view = a[:10].t()
        a.add_(1)
        given.mul_(2)
        b = given * 2  # 4,000 bytes
        assert held.live == 2**20 + 4000
        del a, view
        assert held.live == 4000  # freed once the view is gone too
        c = torch.empty(512, 1024)  # 2 MiB
        del c
    assert held.peak == 2 * 2**20 + 4000 and held.live == 4000 and b.numel() == 1000
