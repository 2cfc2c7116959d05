"""The governor: catch a catastrophic update and undo it.

After every update the trainer hands the step's (all-reduced, so identical on every rank) metrics to
`Governor.observe`. A value that is NaN/inf, or that lies more than `k_sigma` standard deviations from
the mean of a running window of accepted steps, is a panic. On `min_panics` consecutive panics the
trainer restores the last good in-memory `Snapshot` (models, optimizer moments, schedulers), skips the
batch and logs a `governor.rollback` event. While a panic is pending the new weights are not pushed to
the engine, so the engine only ever samples from accepted weights.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from train.models.master_weights import MasterModule


@dataclass
class Verdict:
    action: str  # "accept" | "hold" (panic, not yet min_panics in a row) | "rollback"
    reason: str | None = None


def detect(name: str, value: float, history: list[float], k_sigma: float, min_history: int,
           rel_std_floor: float, max_weight_change: float = math.inf) -> str | None:
    """Why `value` of metric `name` is a catastrophe, or None. A `*weight_change` (the update's
    relative change of the weight norm) above `max_weight_change` is one from the first step on, no
    history needed. Spikes need `min_history` accepted values; the spread is max(std, rel_std_floor *
    |mean|) so a near-constant history does not make ordinary noise look like a spike. Gradient norms
    only spike upwards; losses either way."""
    if not math.isfinite(value):
        return f"{name} is {value}"
    if name.endswith("weight_change"):
        if value > max_weight_change:
            return (f"{name} {value:.3g}: the update changed the weight norm by {100 * value:.3g}% "
                    f"(> trainer.governor.max_weight_change={max_weight_change:g})")
        return None
    if len(history) < min_history:
        return None
    mean = sum(history) / len(history)
    std = math.sqrt(sum((h - mean) ** 2 for h in history) / len(history))
    spread = max(std, rel_std_floor * abs(mean), 1e-12)
    dev = value - mean if "grad_norm" in name else abs(value - mean)
    if dev > k_sigma * spread:
        return f"{name} spike: {value:.6g} vs window mean {mean:.6g} (std {std:.3g}, > {k_sigma:g} sigma)"
    return None


class Governor:
    def __init__(self, watch: list[str], window: int, k_sigma: float, min_history: int, min_panics: int,
                 rel_std_floor: float, max_weight_change: float = math.inf):
        self.watch, self.window, self.k_sigma = list(watch), window, k_sigma
        self.max_weight_change = max_weight_change
        self.min_history, self.min_panics, self.rel_std_floor = min_history, min_panics, rel_std_floor
        self.history: dict[str, list[float]] = {}
        self.panics = 0

    def check(self, metrics: dict[str, float]) -> str | None:
        reasons = [r for name in self.watch if name in metrics
                   if (r := detect(name, float(metrics[name]), self.history.get(name, []), self.k_sigma,
                                   self.min_history, self.rel_std_floor, self.max_weight_change))]
        return "; ".join(reasons) or None

    def observe(self, metrics: dict[str, float], extra: list[str] | tuple[str, ...] = ()) -> Verdict:
        """Judge a finished update; `extra`: reasons found elsewhere (the health detector's escalated alarms)
        that count as panics too."""
        reason = "; ".join([r for r in (self.check(metrics), *extra) if r]) or None
        if reason is None:
            self.panics = 0
            for name in self.watch:
                if name in metrics:
                    self.history[name] = (self.history.get(name, []) + [float(metrics[name])])[-self.window:]
            return Verdict("accept")
        self.panics += 1
        if self.panics >= self.min_panics:
            self.panics = 0
            return Verdict("rollback", reason)
        return Verdict("hold", reason)

    def state_dict(self) -> dict:
        return {"history": copy.deepcopy(self.history), "panics": self.panics}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.panics = int(state["panics"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Snapshot:
    """A copy of this rank's shards of the trainable workers' state parts (model, optimizer state,
    scheduler; see Trainable.state_parts), in CPU memory."""

    def __init__(self, workers: dict):
        parts = [w.state_parts() for w in workers.values()]
        self.parts = [(p["model"], p["optimizer"], p["scheduler"]) for p in parts]
        self.saved = [self._take(*p) for p in self.parts]

    @staticmethod
    def _take(model, optimizer, scheduler) -> dict:
        # Trainable parameters only: frozen ones (a LoRA base) never change, so need no copy.
        params = [_local(p.detach()).to("cpu", copy=True) for p in model.parameters() if p.requires_grad]
        state = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                s = optimizer.state.get(p)
                state.append(None if not s else {k: _local(v.detach()).to("cpu", copy=True)
                                                 if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                                 for k, v in s.items()})
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return {"params": params, "state": state, "groups": groups, "scheduler": copy.deepcopy(scheduler.state_dict())}

    @torch.no_grad()
    def restore(self) -> None:
        for (model, optimizer, scheduler), saved in zip(self.parts, self.saved):
            for p, value in zip([p for p in model.parameters() if p.requires_grad], saved["params"]):
                _local(p).copy_(value)
            if isinstance(model, MasterModule):  # fp32 masters written in place: cast them into the bf16 model
                model.refresh()
            flat = [p for g in optimizer.param_groups for p in g["params"]]
            for p, s in zip(flat, saved["state"]):
                if s is None:
                    optimizer.state.pop(p, None)
                    continue
                current = optimizer.state[p]
                for k, v in s.items():
                    if isinstance(v, torch.Tensor) and isinstance(current.get(k), torch.Tensor):
                        _local(current[k]).copy_(v)
                    else:
                        current[k] = copy.deepcopy(v)
            for g, saved_g in zip(optimizer.param_groups, saved["groups"]):
                g.update(copy.deepcopy(saved_g))
            optimizer.zero_grad(set_to_none=True)
            scheduler.load_state_dict(copy.deepcopy(saved["scheduler"]))
