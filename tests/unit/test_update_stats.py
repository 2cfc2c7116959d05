"""UpdateStats, where every loss hook puts its metrics: adding a device value never reads it (on a GPU each read
stops the host until the device has caught up), and `settle` gives the floats that adding `float(value)` one at
a time gave, bit for bit."""
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.models.trainable import UpdateStats


class Reads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_metrics_stay_on_the_device_until_settled_and_sum_as_python_floats_did():
    g = torch.Generator().manual_seed(3)
    values = [torch.randn((), generator=g) * 10 ** k for k in range(-3, 4)]  # float32 scalars of many scales
    stats = UpdateStats()
    with Reads() as reads:
        for v in values:
            stats.add("loss", v)
            stats.add("tokens", 3.0)  # a host float among them
            stats.max("ratio_max", v)
        stats.max("ratio_max", torch.tensor(-math.inf))  # an empty pack's identity
    assert reads.count == 0
    stats.settle()
    expected = 0.0
    for v in values:
        expected += float(v)
    assert stats.sums["loss"] == expected  # the same float64 additions in the same order
    assert stats.sums["tokens"] == 3.0 * len(values)
    assert stats.maxima["ratio_max"] == max(float(v) for v in values)
    assert all(type(x) is float for x in (*stats.sums.values(), *stats.maxima.values()))


def test_maxima_shared_across_mini_batches_combine_floats_and_device_values():
    first = UpdateStats()
    first.max("ratio_max", torch.tensor(2.5))
    first.settle()
    second = UpdateStats(maxima=first.maxima)  # run_update shares one maxima dict across mini-batches
    second.max("ratio_max", torch.tensor(1.5))
    second.max("sampler_ratio_max", 4.0)
    second.settle()
    assert first.maxima == {"ratio_max": 2.5, "sampler_ratio_max": 4.0}
