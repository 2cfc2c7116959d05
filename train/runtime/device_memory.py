"""Peak device memory per phase of a training step: `memory/<phase>_peak_gib` in metrics.jsonl.

On CUDA each phase (rollout, reference, update, push) resets the allocator's peak when it starts and
reads it when it ends, so a run's memory by phase is in its metrics (and `python -m train.utils.plot`
plots them like any metric); train/models/memory_plan.py estimates the same figures from a config.
On CPU nothing is recorded: the process' memory there has no per-phase peak to reset.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

GIB = 2**30


class PhasePeaks:
    """`with peaks.phase("rollout", metrics): ...` adds metrics["memory/rollout_peak_gib"]. `reset` and
    `peak` default to torch.cuda's for `device` (None: off, as on CPU)."""

    def __init__(self, device: torch.device, reset: Callable[[], None] | None = None,
                 peak: Callable[[], int] | None = None) -> None:
        if reset is None and peak is None and device.type == "cuda":
            reset, peak = (lambda: torch.cuda.reset_peak_memory_stats(device)), (lambda: torch.cuda.max_memory_allocated(device))
        self.reset, self.peak = reset, peak

    @contextlib.contextmanager
    def phase(self, name: str, metrics: dict[str, float]) -> Iterator[None]:
        if self.reset is None:
            yield
            return
        self.reset()
        yield
        key = f"memory/{name}_peak_gib"
        metrics[key] = max(metrics.get(key, 0.0), self.peak() / GIB)  # a phase run twice keeps its larger peak
