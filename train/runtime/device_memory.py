"""Peak device memory per phase of a training step: `memory/<phase>_peak_gib` in metrics.jsonl.

On CUDA each phase (rollout, reference, update, push) resets the allocator's peak when it starts and
reads it when it ends, so a run's memory by phase is in its metrics (and `python -m train.utils.plot`
plots them like any metric); train/models/memory_plan.py estimates the same figures from a config.
On CPU nothing is recorded: the process' memory there has no per-phase peak to reset. The values are
this rank's (no collective); the trainer logs rank 0's.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

GIB = 2**30


@contextlib.contextmanager
def phase_peak(device: torch.device, name: str, metrics: dict[str, float],
               reset: Callable[[], None] | None = None, peak: Callable[[], int] | None = None) -> Iterator[None]:
    """`with phase_peak(device, "rollout", metrics): ...` sets metrics["memory/rollout_peak_gib"]; a phase run
    twice keeps its larger peak. `reset` and `peak` default to torch.cuda's for a CUDA `device`; on
    another device without them nothing is recorded."""
    if reset is None and peak is None and device.type == "cuda":
        reset, peak = (lambda: torch.cuda.reset_peak_memory_stats(device)), (lambda: torch.cuda.max_memory_allocated(device))
    if reset is None or peak is None:
        yield
        return
    reset()
    yield
    key = f"memory/{name}_peak_gib"
    metrics[key] = max(metrics.get(key, 0.0), peak() / GIB)
