"""The interface every rollout engine implements (hf today, sglang on GPUs).

Token ids in, token ids out: an engine never sees text, so what the model sampled is
exactly what the trainer trains on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop: tuple[str, ...] = ()  # stop strings, checked on the decoded response
    seed: int | None = None  # per-request seed: sampling does not depend on batch composition


@dataclass
class Generation:
    token_ids: list[int]  # sampled tokens, the stop/EOS token included when one was sampled
    logprobs: list[float]  # log p(token) under the sampling distribution's logits / temperature
    finish_reason: FinishReason
    extra: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...
