"""The forgetting gate: held-out test sets from earlier tasks, guarded while a model trains on a new one.

`trainer.forgetting.watch` names evaluation metrics (`rewards/test`, or `rewards/test/<source>` for a source of
`data.test_data_path`, e.g. the earlier task's held-out rows). The first evaluation sets each one's baseline;
after every later evaluation a watched metric more than `max_drop` below its baseline is forgetting:
`action: warn` says so (the step, the metric, baseline and value), `action: rollback` also restores the actor
(and critic), their optimizer moments and schedulers to the last evaluation that passed, and pushes those
weights to the engine; `action: raise_kl` multiplies the KL penalty's coefficient (actor.kl.coef > 0: the pull
towards the reference, the starting model) by `kl_factor`, so training goes on closer to where it started. Whatever
the action, the sources whose watched metric fell (`rewards/test/<source>`) are `failing` until an evaluation
passes: prioritized replay favours their training groups meanwhile (`data.replay.favour_failing`). The
snapshot is a CPU copy of this rank's shards of the trainable state (as the
governor's), retaken at each passing evaluation; after a resume the first passing evaluation takes it again.
"""
from __future__ import annotations


class ForgettingGate:
    def __init__(self, watch: list[str], max_drop: float, action: str, kl_factor: float = 2.0,
                 max_kl: float | None = None) -> None:
        self.watch, self.max_drop, self.action, self.kl_factor = list(watch), max_drop, action, kl_factor
        self.max_kl = max_kl  # kl_to_start/test above this is also an alarm (train/trainer/drift.py)
        self.baseline: dict[str, float] = {}
        self.passed: int | None = None  # the step of the last evaluation that passed
        self.kl_scale = 1.0  # what action raise_kl has multiplied actor.kl.coef by so far
        self.failing: list[str] = []  # the data sources whose watched metric fell at the last evaluation

    @classmethod
    def from_config(cls, section) -> "ForgettingGate | None":
        return (cls(list(section.watch), float(section.max_drop), str(section.action), float(section.kl_factor),
                    section.max_kl) if section.watch or section.max_kl is not None else None)

    def raise_kl(self) -> float:
        """Action raise_kl after an alarm: the new multiplier of actor.kl.coef."""
        self.kl_scale *= self.kl_factor
        return self.kl_scale

    def judge(self, step: int, scores: dict[str, float]) -> str | None:
        """Why this evaluation shows forgetting, or None (it passed; the first one sets the baselines)."""
        drops, kl_drift, self.failing = [], [], []
        for name in self.watch:
            if name not in scores:
                continue
            value = float(scores[name])
            base = self.baseline.setdefault(name, value)
            if base - value > self.max_drop:
                drops.append(f"{name} {value:.3f} is {base - value:.3f} below its first evaluation's {base:.3f}")
                if name.count("/") == 2:  # rewards/test/<source>, pass@k/test/<source>: that source's rows
                    self.failing.append(name.rsplit("/", 1)[1])
        kl = scores.get("kl_to_start/test")
        if self.max_kl is not None and kl is not None and kl > self.max_kl:
            kl_drift.append(f"kl_to_start/test {kl:.4f} is above trainer.forgetting.max_kl={self.max_kl:g}")
        if drops:  # (the drop's threshold named once, after the drops, not after the KL)
            drops[-1] += f" (> trainer.forgetting.max_drop={self.max_drop:g})"
        if drops or kl_drift:
            return "; ".join(drops + kl_drift)
        self.passed = step
        return None

    def state_dict(self) -> dict:
        return {"baseline": dict(self.baseline), "passed": self.passed, "kl_scale": self.kl_scale,
                "failing": list(self.failing)}

    def load_state_dict(self, state: dict) -> None:
        self.baseline, self.passed = dict(state["baseline"]), state["passed"]
        self.kl_scale = state.get("kl_scale", 1.0)
        self.failing = list(state.get("failing", []))
