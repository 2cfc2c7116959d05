"""Which rollout source a run uses (train/trainer/rollouts.py, train/trainer/inflight.py)."""
from __future__ import annotations

from train.datasets.config import DataConfig
from train.parallel.distributed import DistContext
from train.runtime.watchdog import Watchdog
from train.trainer.inflight import ContinuousRollouts, InflightRollouts
from train.trainer.rollouts import PrefetchedRollouts, RolloutSource
from train.workers.config import RolloutConfig


def rollout_source(settings: RolloutConfig, data: DataConfig, ctx: DistContext, *, total_steps: int,
                   watchdog: Watchdog, **parts) -> RolloutSource:
    """Synchronous; rollouts made ahead (`rollout.max_staleness` >= 1); or in flight across weight updates
    (`rollout.inflight`)."""
    if settings.inflight:
        kind = ContinuousRollouts if settings.inflight_mode == "continuous" else InflightRollouts
        return kind(settings, data, ctx, total_steps=total_steps, watchdog=watchdog, **parts)
    if settings.max_staleness > 0:
        return PrefetchedRollouts(settings, data, ctx, total_steps=total_steps, watchdog=watchdog, **parts)
    return RolloutSource(settings, data, ctx, **parts)
