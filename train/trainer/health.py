"""The training-health detector: rules over each step's metrics that say, in words, when a run is degrading.

The governor (train/trainer/governor.py) catches catastrophes: a NaN, a k-sigma spike, an update that blows the
weights up. These rules catch slower trouble that a spike test does not see, each on a global metric (the same
on every rank), with its threshold under `trainer.health.*`:

    ratio          actor/ratio_max above ratio_max, or actor/ratio_min below ratio_min: the policy that
                   trains has left the one that sampled (stale rollouts, a learning rate too high)
    clip           actor/clip_fraction above clip_fraction: most of the update is being clipped away
    entropy        actor/entropy below entropy_floor: the policy has collapsed onto a few tokens
    critic         critic/explained_variance below explained_variance_floor: the critic predicts returns worse
                   than their mean (PPO with a critic)
    grad_norm      actor/grad_norm above grad_norm_factor x the median of the last `window` steps
    length         response_length/train grew length_growth-fold over `window` steps while rewards/train rose
                   by less than flat_reward: longer answers, no better ones (a reward being gamed, a loop)

A rule alarms once it has held `patience` steps in a row, and again every `patience` steps while it holds.
Rules that compare with the past wait `warmup` steps. An alarm is a warning naming the step, the rule, the
metric and its value; with `escalate: governor` it is also a panic for the governor, which holds the update
and rolls it back after `trainer.governor.min_panics` panics.
"""
from __future__ import annotations

import inspect
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable

Rule = Callable[["HealthDetector", dict[str, float]], "str | None"]


@dataclass(frozen=True)
class Alarm:
    rule: str
    message: str  # names the metric, its value and the threshold


class HealthDetector:
    def __init__(self, *, escalate: str = "warn", patience: int = 3, window: int = 20, warmup: int = 5,
                 ratio_max: float = 20.0, ratio_min: float = 0.01, clip_fraction: float = 0.3,
                 entropy_floor: float = 1e-3, explained_variance_floor: float = -1.0,
                 grad_norm_factor: float = 10.0, length_growth: float = 2.0, flat_reward: float = 0.02) -> None:
        self.escalate, self.patience, self.window, self.warmup = escalate, patience, window, warmup
        self.ratio_max, self.ratio_min, self.clip_fraction = ratio_max, ratio_min, clip_fraction
        self.entropy_floor, self.explained_variance_floor = entropy_floor, explained_variance_floor
        self.grad_norm_factor, self.length_growth, self.flat_reward = grad_norm_factor, length_growth, flat_reward
        self.streaks: dict[str, int] = {}
        self.history: dict[str, deque[float]] = {}  # the last `window` + 1 values of the metrics rules compare
        self.steps = 0

    @classmethod
    def from_config(cls, section) -> "HealthDetector | None":
        if not section.enable:
            return None
        return cls(**{k: getattr(section, k) for k in inspect.signature(cls).parameters})  # every key but enable

    # ------------------------------------------------------------------ the rules

    def _ratio(self, m: dict[str, float]) -> str | None:
        high, low = m.get("actor/ratio_max"), m.get("actor/ratio_min")
        if high is not None and high > self.ratio_max:
            return f"actor/ratio_max {high:.3g} > {self.ratio_max:g}"
        if low is not None and low < self.ratio_min:
            return f"actor/ratio_min {low:.3g} < {self.ratio_min:g}"
        return None

    def _clip(self, m: dict[str, float]) -> str | None:
        v = m.get("actor/clip_fraction")
        return f"actor/clip_fraction {v:.3g} > {self.clip_fraction:g}" if v is not None and v > self.clip_fraction \
            else None

    def _entropy(self, m: dict[str, float]) -> str | None:
        v = m.get("actor/entropy")
        return f"actor/entropy {v:.3g} < {self.entropy_floor:g}" if v is not None and v < self.entropy_floor else None

    def _critic(self, m: dict[str, float]) -> str | None:
        v = m.get("critic/explained_variance")
        if v is None or self.steps <= self.warmup or v >= self.explained_variance_floor:
            return None
        return f"critic/explained_variance {v:.3g} < {self.explained_variance_floor:g}"

    def _grad_norm(self, m: dict[str, float]) -> str | None:
        v, past = m.get("actor/grad_norm"), self.history.get("actor/grad_norm")
        if v is None or not past or len(past) < self.warmup:
            return None
        median = statistics.median(list(past)[-self.window:])
        if v > self.grad_norm_factor * max(median, 1e-12):
            return f"actor/grad_norm {v:.3g} > {self.grad_norm_factor:g} x its median {median:.3g}"
        return None

    def _length(self, m: dict[str, float]) -> str | None:
        length, reward = m.get("response_length/train"), m.get("rewards/train")
        lengths, rewards = self.history.get("response_length/train"), self.history.get("rewards/train")
        if length is None or reward is None or not lengths or len(lengths) < self.window:
            return None
        then_length, then_reward = lengths[-self.window], rewards[-self.window]  # type: ignore[index]
        if length > self.length_growth * max(then_length, 1.0) and reward - then_reward < self.flat_reward:
            return (f"response_length/train {length:.1f} is {length / max(then_length, 1.0):.2g}x its value "
                    f"{self.window} steps ago while rewards/train moved {reward - then_reward:+.3g} "
                    f"(< {self.flat_reward:g})")
        return None

    RULES: dict[str, Rule] = {"ratio": _ratio, "clip": _clip, "entropy": _entropy, "critic": _critic,
                              "grad_norm": _grad_norm, "length": _length}
    COMPARED = ("actor/grad_norm", "response_length/train", "rewards/train")

    # ------------------------------------------------------------------ per step

    def observe(self, metrics: dict[str, float]) -> list[Alarm]:
        """This step's alarms (a rule that held `patience` steps in a row, then every `patience` steps)."""
        self.steps += 1
        alarms = []
        for name, rule in self.RULES.items():
            found = rule(self, metrics)
            self.streaks[name] = self.streaks.get(name, 0) + 1 if found else 0
            if found and self.streaks[name] % self.patience == 0:
                alarms.append(Alarm(name, f"{found} for {self.streaks[name]} steps"))
        for key in self.COMPARED:
            if key in metrics:
                self.history.setdefault(key, deque(maxlen=self.window + 1)).append(float(metrics[key]))
        return alarms

    def state_dict(self) -> dict:
        return {"streaks": dict(self.streaks), "history": {k: list(v) for k, v in self.history.items()},
                "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.streaks = dict(state["streaks"])
        self.history = {k: deque(v, maxlen=self.window + 1) for k, v in state["history"].items()}
        self.steps = int(state["steps"])
