"""The engine samples from exactly the weights the trainer accepted: weight pushes (gathered in flat
buckets, train/parallel/weight_sync.py), their verification (checksums and the probe,
train/trainer/sync_check.py), a fingerprint of what was pushed, and the governor's accept / hold /
rollback (train/trainer/governor.py) in one place.

Without the governor every update is pushed. With it, an update is pushed only once accepted; a
held (suspect) update stays out of the engine; a rollback restores the last accepted snapshot, which
the engine already holds, so nothing is pushed. Every method is collective: all ranks call it.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

import torch

from train.engines.base import RolloutEngine
from train.models.lora import adapter_state, has_lora
from train.parallel.weight_sync import gather_full_tensors, unique_state
from train.runtime.logging import RunLogger
from train.runtime.watchdog import Watchdog
from train.trainer.forgetting import ForgettingGate
from train.trainer.governor import Governor, Snapshot
from train.trainer.health import HealthDetector
from train.trainer.sync_check import PushRecord, verify_push
from train.utils.checksum import Checksummer

MB = 1 << 20


def fingerprinted(named: Iterable[tuple[str, torch.Tensor]], acc: list[float]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, tensor) pairs through, adding sum|w| (accumulated in float64) of all of them into acc[0]
    once the stream ends (one read-back per push, not one per tensor)."""
    total: torch.Tensor | None = None
    for name, value in named:
        # One pass, no float64 copy of the tensor (a 2x-sized temporary per tensor cost 8x the push).
        norm = torch.linalg.vector_norm(value.detach(), ord=1, dtype=torch.float64)
        total = norm if total is None else total + norm.to(total.device)
        yield name, value
    if total is not None:
        acc[0] += float(total)


class PolicySync:
    def __init__(self, model: torch.nn.Module, engine: RolloutEngine, bucket_mb: float,
                 governor: Governor | None, workers: dict, log: RunLogger, *, verify: bool = True,
                 watchdog: Watchdog | None = None, push_timeout_s: float | None = None,
                 device: torch.device = torch.device("cpu"), rank: int = 0,
                 health: HealthDetector | None = None, forgetting: ForgettingGate | None = None) -> None:
        self.model, self.engine, self.governor, self.workers, self.log = model, engine, governor, workers, log
        self.health, self.forgetting = health, forgetting
        if forgetting is not None and forgetting.action == "raise_kl":  # as raised before a resume
            self._scale_kl()
        self.evaluated: Snapshot | None = None  # the trainable state at the last evaluation that passed
        self.bucket_bytes = max(1, int(bucket_mb * MB))
        self.verify, self.watchdog, self.push_timeout_s = verify, watchdog, push_timeout_s
        self.device, self.rank = device, rank
        self.pushed_fingerprint: float | None = None
        self.checksummer = Checksummer()  # kept between pushes: each push sends the same layout
        self.snapshot = Snapshot(workers) if governor is not None else None
        # A LoRA actor pushes its adapters only: the engine holds the same frozen base.
        self.adapters_only = has_lora(model)

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full weights (with LoRA, its adapters) in the engine's dtype, bucket by bucket
        (collective)."""
        named = adapter_state(self.model) if self.adapters_only else unique_state(self.model)
        return gather_full_tensors(named, self.bucket_bytes, getattr(self.engine, "dtype", None))

    def push(self, step: int = 0) -> float:
        """Push the actor's weights into the engine; the seconds it took. With `verify`, the engine's
        checksums must match what was sent (else WeightSyncError naming the step and bucket); with the
        governor, the pushed weights' fingerprint is kept (its rollback events compare against it). A
        push running past `push_timeout_s` ends the rank through the watchdog, naming the bucket."""
        start = time.perf_counter()
        record = PushRecord(self.bucket_bytes, self.checksummer)
        named = self.full_tensors()
        acc = [0.0]
        if self.governor is not None:
            named = fingerprinted(named, acc)
        if self.verify:
            named = record.recording(named)

        def where() -> str:
            return f"weight push at step {step}, {record.current if self.verify else 'bucket unknown (verify_push off)'}"

        with (self.watchdog.phase("weight push", self.push_timeout_s, "rollout.push_timeout_s", where)
              if self.watchdog is not None else contextlib.nullcontext()), torch.no_grad():
            self.engine.update_weights(named)
            if self.verify:
                verify_push(self.engine, record, step, self.rank, self.device)
                self.checksummer.release()  # its buffer's memory back for the update; the layouts stay
        self.engine.weight_version = step  # generations from now on are tagged with it
        if self.governor is not None:
            self.pushed_fingerprint = acc[0]
        return time.perf_counter() - start

    def fingerprint(self) -> float:
        """sum|w| of the actor's current weights as the engine would receive them (collective)."""
        acc = [0.0]
        with torch.no_grad():
            for _ in fingerprinted(self.full_tensors(), acc):
                pass
        return acc[0]

    def after_evaluation(self, step: int, scores: dict[str, float]) -> dict[str, float]:
        """The forgetting gate on an evaluation's (global) scores: a passing one is snapshotted (action rollback);
        a failing one is a warning, and with action rollback the last passing state comes back and is pushed."""
        gate = self.forgetting
        if gate is None:
            return {}
        why = gate.judge(step, scores)
        if why is None:
            if gate.action == "rollback":
                self.evaluated = Snapshot(self.workers)
            return {"forgetting/alarm": 0.0}
        out = {"forgetting/alarm": 1.0}
        if gate.action == "raise_kl":
            gate.raise_kl()
            out["forgetting/kl_coef"] = self._scale_kl()
        undo = gate.action == "rollback" and self.evaluated is not None
        if undo:
            self.evaluated.restore()
            if self.snapshot is not None:  # the governor's last good state is now the restored one
                self.snapshot = self.evaluated
            self.push(step)
            out["forgetting/rollback"] = 1.0
        after = (f"rolled back to step {gate.passed}'s evaluation" if undo else
                 "no passing evaluation since the start or the resume to roll back to" if gate.action == "rollback"
                 else f"actor.kl.coef raised to {out['forgetting/kl_coef']:.4g}" if gate.action == "raise_kl"
                 else "trainer.forgetting.action=rollback restores the last passing evaluation's weights")
        self.log.write(f"warning: step {step}: forgetting: {why}: {after}")
        self.log.event("forgetting", step, {"reason": why, "rolled_back_to": gate.passed if undo else None})
        return out

    def _scale_kl(self) -> float:
        """The actor's KL coefficient: actor.kl.coef times what trainer.forgetting.action=raise_kl has raised it by."""
        actor = self.workers["actor"]
        actor.kl_coef = actor.cfg.kl.coef * self.forgetting.kl_scale
        return actor.kl_coef

    def check_health(self, step: int, metrics: dict[str, float]) -> list:
        """The health detector's alarms for this step, each a warning line and a `health.alarm` event."""
        if self.health is None:
            return []
        alarms = self.health.observe(metrics)
        for a in alarms:
            self.log.write(f"step {step}: health: {a.rule}: {a.message}")
            self.log.event("health.alarm", step, {"rule": a.rule, "message": a.message})
        return alarms

    def after_update(self, step: int, metrics: dict[str, float], push: bool) -> dict[str, float]:
        """Push (and with the governor, judge) a finished update; metrics of what happened."""
        alarms = self.check_health(step, metrics)
        health = {"health/alarms": float(len(alarms))} if self.health is not None else {}
        if self.governor is None:
            return {**health, **({"time/weight_sync_s": self.push(step)} if push else {})}
        escalated = [f"health: {a.rule}: {a.message}" for a in alarms if self.health.escalate == "governor"]
        verdict = self.governor.observe(metrics, escalated)  # global metrics: every rank takes the same branch
        out = {"governor/panic": float(verdict.action != "accept"), "governor/rollback": 0.0, **health}
        if verdict.action == "accept":
            self.snapshot = Snapshot(self.workers)
            if push:
                out["time/weight_sync_s"] = self.push(step)
                out["engine/weights_fingerprint"] = self.pushed_fingerprint
        elif verdict.action == "hold":  # suspect weights stay out of the engine until judged
            self.log.event("governor.panic", step, {"reason": verdict.reason, "panics": self.governor.panics})
        else:
            bad = self.fingerprint()
            self.snapshot.restore()
            restored = self.fingerprint()
            out["governor/rollback"] = 1.0
            # The engine never received weights after the snapshot (pushes wait for an accept), so
            # it already holds the restored ones: nothing to push.
            self.log.event("governor.rollback", step, {
                "reason": verdict.reason, "skipped_step": step, "bad_fingerprint": bad,
                "restored_fingerprint": restored, "engine_fingerprint": self.pushed_fingerprint})
            self.log.write(f"step {step}: governor rolled back ({verdict.reason})")
        return out
