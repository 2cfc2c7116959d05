"""Distillation teachers by data source (`distill.teachers`): which teacher scores which sample, and the
reference slot that holds several of them.

Each teacher scores only the samples routed to it, so the slot's compute per step is one reference pass
over the batch however many teachers there are; its memory is every teacher's weights, each sharded over
the ref_actor layout like a reference (ref_actor.offload_model keeps them on the CPU between passes)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from train.models.actor import Actor
from train.parallel.step_batch import StepBatch


@dataclass(frozen=True)
class TeacherRoutes:
    """The distinct teacher models and the one each data source's samples go to."""
    folders: tuple[str, ...]  # one per distinct model (two sources may share one), built in this order
    by_source: Mapping[str | None, int]  # source -> index into folders; None: every source not named

    @classmethod
    def of(cls, teacher: str | None, teachers: Mapping[str, str]) -> "TeacherRoutes":
        """From distill.teacher's folder (the fallback, or None) and distill.teachers' {source: folder}."""
        folders: list[str] = []
        by_source: dict[str | None, int] = {}
        for source, folder in ([(None, teacher)] if teacher is not None else []) + sorted(teachers.items()):
            same = [k for k, f in enumerate(folders) if os.path.realpath(f) == os.path.realpath(folder)]
            if not same:
                folders.append(folder)
            by_source[source] = same[0] if same else len(folders) - 1
        return cls(tuple(folders), by_source)

    def route(self, source: str | None) -> int:
        """The teacher that scores a sample of `source`; -1: none (the sample learns from its task reward)."""
        return self.by_source.get(source, self.by_source.get(None, -1))


class RoutedTeachers:
    """Several frozen teachers in the reference slot, all in one layout; each scores the samples whose step
    batch index routes them to it (BatchIndex.route). A sample no teacher scores gets zeros, which the
    advantages read as "no teacher" from the same route."""

    def __init__(self, teachers: list[Actor]):
        if not teachers:
            raise ValueError("RoutedTeachers needs at least one teacher")
        self.teachers = teachers
        self.layout = teachers[0].layout

    def compute_logprobs(self, batch: StepBatch) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(batch)
        for k, teacher in enumerate(self.teachers):  # every rank, every teacher, in the same order
            positions = [i for i, g in enumerate(batch.members) if batch.index.route[g] == k]
            for i, logp in enumerate(teacher.compute_logprobs(batch, positions)):
                if logp is not None:
                    out[i] = logp
        return [logp if logp is not None else torch.zeros(batch.ids[i].numel() - 1) for i, logp in enumerate(out)]
