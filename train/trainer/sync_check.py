"""Checking that the engine samples from the weights the trainer pushed (issue 18 item 8).

Two checks, both collective (every rank calls them; a failure on one rank stops every rank):

- **Checksums** (after every push, `trainer.verify_push`): while the weights stream into the engine,
  the trainer takes an exact integer checksum of every tensor it sends (train/utils/checksum.py: its
  32-bit words summed with position weights, with integer wrap-around); then the engine reports the
  same checksum of what it holds under each name. Integer sums are exact and independent of summation
  order, so "equal" means equal, on any device. Both sides take a group of tensors (up to
  `CHUNK_BYTES`) in a fixed number of kernels, and the comparison reads back one vector per side. Tensors are numbered into buckets of
  `rollout.bucket_size_mb` in push order, so a mismatch names the step, the bucket and the tensors.
  Engines that cannot report their tensors by name (SGLang fuses and shards them) skip this check;
  the probe covers them.
- **The probe** (every `trainer.sync_probe_every` steps): the engine scores a fixed token sequence
  (`score`: log p(token | prefix) at the training temperature) and the actor computes the same
  log-probs through the step batch path the update uses; the mean absolute difference must stay
  under `trainer.sync_probe_tol` (to rounding: 1e-3 when both compute in float32, 0.1 otherwise).

The checksum catches any difference, even one update's worth of lr 1e-6; the probe catches what the
checksum cannot see (a wrong layout or config in an engine that fuses tensors, a broken tokenizer
mapping), but only differences larger than rounding.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from train.parallel.collectives import all_reduce_max
from train.parallel.step_batch import dispatch, exchange_index
from train.utils.checksum import CHUNK_BYTES, Checksummer
from train.utils.tensor_stream import grouped


class WeightSyncError(RuntimeError):
    """The engine does not hold what was pushed, or a probe disagrees."""


@dataclass
class PushRecord:
    """What one push sent: each tensor's checksum and its bucket number, in push order."""
    bucket_bytes: int
    checksummer: Checksummer = field(default_factory=Checksummer)  # the pusher's own: its layouts last between pushes
    names: list[str] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)
    checksums: list[torch.Tensor] = field(default_factory=list)  # one int64 vector per group of tensors
    _filled: int = 0  # bytes in the current bucket

    def recording(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass (name, tensor) pairs through, recording each one's checksum and bucket (a group of
        tensors at a time: one batched checksum per group, no host sync)."""
        for group in grouped(named, CHUNK_BYTES):
            for name, tensor in group:
                size = tensor.numel() * tensor.element_size()
                bucket = self.buckets[-1] if self.buckets else 0
                if self._filled and self._filled + size > self.bucket_bytes:
                    bucket, self._filled = bucket + 1, 0
                self._filled += size
                self.names.append(name)
                self.buckets.append(bucket)
            self.checksums.append(self.checksummer([t for _, t in group]))
            yield from group

    @property
    def current(self) -> str:
        """Where the push is: for the watchdog's line when a push hangs."""
        if not self.names:
            return "before the first bucket"
        return f"bucket {self.buckets[-1]} (last tensor sent: {self.names[-1]})"


def mismatches(record: PushRecord, held: dict[str, int]) -> list[tuple[int, str]]:
    """(bucket, name) of every pushed tensor whose checksum in the engine (`held`) differs or is missing."""
    if not record.names:
        return []
    sent = torch.cat(record.checksums).tolist()  # one device-to-host copy, not one per tensor
    return [(record.buckets[i], n) for i, (n, value) in enumerate(zip(record.names, sent)) if held.get(n) != value]


def verify_push(engine, record: PushRecord, step: int, rank: int, device: torch.device) -> None:
    """Compare the engine's checksums with what was sent; raise WeightSyncError on every rank if any
    rank's engine differs. Engines without `weight_checksums` are skipped (every rank alike)."""
    report = getattr(engine, "weight_checksums", None)
    bad = mismatches(record, report(record.names)) if report is not None else []
    worst = all_reduce_max(float(len(bad)), device)
    if bad:
        buckets = sorted({b for b, _ in bad})
        names = ", ".join(n for _, n in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise WeightSyncError(
            f"step {step}: the rollout engine on rank {rank} does not hold the weights just pushed: bucket(s) "
            f"{buckets} of {record.buckets[-1] + 1} differ ({names}); it would sample from other weights than "
            "the trainer's. Look for an engine error above; trainer.verify_push=false turns this check off")
    if worst > 0:
        raise WeightSyncError(f"step {step}: the rollout engine on another rank does not hold the weights just "
                              "pushed (its own message names the bucket)")


def probe_tolerance(configured: float | None, engine_dtype: torch.dtype, actor_dtype: str) -> float:
    """`trainer.sync_probe_tol`, or rounding for the precisions in play."""
    if configured is not None:
        return float(configured)
    both_fp32 = engine_dtype == torch.float32 and actor_dtype == "float32"
    return 1e-3 if both_fp32 else 0.1


def check_probe(engine_logp: torch.Tensor, trainer_logp: torch.Tensor, tol: float, step: int, rank: int,
                device: torch.device) -> float:
    """The mean |engine - trainer| log-prob over the probe's tokens, the same on every rank (max over
    ranks); raises WeightSyncError on every rank when it exceeds `tol`."""
    if engine_logp.shape != trainer_logp.shape:
        raise WeightSyncError(f"step {step}: the sync probe has {engine_logp.numel()} engine log-probs but "
                              f"{trainer_logp.numel()} trainer log-probs on rank {rank}")
    diff = (engine_logp.double() - trainer_logp.double()).abs().mean().item()
    worst = all_reduce_max(diff if diff == diff else float("inf"), device)
    if worst > tol:
        raise WeightSyncError(
            f"step {step}: the rollout engine and the trainer disagree on the sync probe: mean |log p difference| "
            f"{worst:.3g} > trainer.sync_probe_tol={tol:g} (rank {rank}: {diff:.3g}); the engine does not sample "
            "from the trainer's weights (or computes differently: dtype, chat template, model config)")
    return worst


def actor_logprobs(actor, ids: list[int], device: torch.device) -> torch.Tensor:
    """The actor's log p(token i | tokens < i), i >= 1, of `ids` through the path the update uses (the
    step batch, packing, every parallel layout): each rank contributes one copy, so every dp group
    holds at least one. Collective."""
    index = exchange_index([len(ids)], [0], [0.0], device)
    batch = dispatch(index, [ids], [[0] + [1] * (len(ids) - 1)], [[0.0] * len(ids)], actor.layout, 1, device)
    return actor.compute_logprobs(batch)[0].float()


# The sync probe's text: any fixed sequence works; the engine and the trainer score the same tokens.
PROBE_TEXT = "The rollout engine samples from the weights the trainer has just pushed: 1 2 3 4 5 6 7 8 9 10."


class SyncProbe:
    """The probe of the module docstring, every `trainer.sync_probe_every` steps after a push."""

    def __init__(self, ids: list[int], every: int | None, tol: float, temperature: float) -> None:
        self.ids, self.every, self.tol, self.temperature = ids[:128], every, tol, temperature

    def due(self, step: int, pushed: bool) -> bool:
        return bool(self.every and step % self.every == 0 and pushed)

    def __call__(self, engine, actor, step: int, ctx) -> float:
        """The engine's and the actor's log-probs of the probe sequence must agree to rounding (they
        hold the same weights after a push); the mean |difference|, or WeightSyncError. Collective."""
        score = getattr(engine, "score", None)
        if score is None or len(self.ids) < 2:
            return float("nan")  # an engine that cannot score a sequence: the checksums are the check
        engine_logp = score(self.ids, self.temperature)
        trainer_logp = actor_logprobs(actor, self.ids, ctx.device)
        return check_probe(engine_logp, trainer_logp, self.tol, step, ctx.rank, ctx.device)
