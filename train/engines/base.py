"""The interface every rollout engine implements (hf today, sglang on GPUs).

Token ids in, token ids out: an engine never sees text, so what the model sampled is
exactly what the trainer trains on.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Literal, Protocol

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """What `rollout.train_sampling_params` / `test_sampling_params` hold. Every engine honours
    these fields; `extra` carries engine-specific keys through unchanged (SGLang's own set)."""
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    min_p: float = 0.0  # keep tokens with p >= min_p * p(most likely); 0: off
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or the response
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the response
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the response
    stop: tuple[str, ...] = ()  # stop strings, checked on the decoded response
    stop_token_ids: tuple[int, ...] = ()  # further end tokens (sampled, kept, finish reason "stop")
    ignore_eos: bool = False  # keep generating past EOS (stop_token_ids still end the response)
    seed: int | None = None  # per-request seed: sampling does not depend on batch composition
    # Not a config key: tokens of this turn sampled before (a turn continued after a weight update,
    # rollout.inflight); a seeded request's uniforms continue from there, so a turn paused and resumed on
    # unchanged weights samples what it would have sampled in one go.
    seed_offset: int = 0
    extra: tuple[tuple[str, Any], ...] = ()  # engine-specific (key, value) pairs, passed through

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


COMMON_SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams) if f.name not in ("extra", "seed_offset"))


class SamplingError(ValueError):
    """A bad sampling parameter; `key` names it."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem


def _number(value: Any, key: str, low: float | None = None, high: float | None = None, *, integer: bool = False,
            low_open: bool = False) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise SamplingError(key, f"expected {'an integer' if integer else 'a number'}, got {value!r}")
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        raise SamplingError(key, f"expected a value in {'(' if low_open else '['}{lo}, {hi}], got {value!r}")
    return value


def sampling_from_mapping(values: Mapping[str, Any], engine_keys: tuple[str, ...] = ()) -> SamplingParams:
    """Build SamplingParams from a config mapping, checking every value. Keys outside the common set
    are accepted only when listed in `engine_keys` (the engine's own parameters) and go to `extra`;
    any other key raises SamplingError naming it and the keys that exist."""
    values = dict(values)
    if "n" in values:
        raise SamplingError("n", "samples per prompt are set by data.responses_per_prompt, not the sampling parameters")
    unknown = sorted(k for k in values if k not in COMMON_SAMPLING_KEYS and k not in engine_keys)
    if unknown:
        allowed = ", ".join(sorted(set(COMMON_SAMPLING_KEYS) | set(engine_keys)))
        raise SamplingError(unknown[0], f"unknown sampling parameter; this engine takes: {allowed}")
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in COMMON_SAMPLING_KEYS or value is None and key != "seed":
            continue
        if key == "max_new_tokens":
            value = _number(value, key, 1, integer=True)
        elif key == "temperature":
            value = float(_number(value, key, 0))
        elif key == "top_p":
            value = float(_number(value, key, 0, 1, low_open=True))
        elif key == "top_k":
            value = _number(value, key, -1, integer=True)  # -1 or 0: off
        elif key == "min_p":
            value = float(_number(value, key, 0, 1))
        elif key == "repetition_penalty":
            value = float(_number(value, key, 0, low_open=True))
        elif key in ("presence_penalty", "frequency_penalty"):
            value = float(_number(value, key, -2, 2))
        elif key == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
                raise SamplingError(key, f"expected a list of non-empty strings, got {value!r}")
            value = tuple(value)
        elif key == "stop_token_ids":
            if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               and t >= 0 for t in value):
                raise SamplingError(key, f"expected a list of token ids, got {value!r}")
            value = tuple(value)
        elif key == "ignore_eos":
            if not isinstance(value, bool):
                raise SamplingError(key, f"expected true or false, got {value!r}")
        elif key == "seed" and value is not None:
            value = _number(value, key, 0, integer=True)
        out[key] = value
    extra = tuple(sorted((k, v) for k, v in values.items() if k not in COMMON_SAMPLING_KEYS))
    return SamplingParams(**out, extra=extra)


@dataclass
class Generation:
    token_ids: list[int]  # sampled tokens, the stop/EOS token included when one was sampled
    logprobs: list[float]  # log p(token) under the sampling distribution's logits / temperature
    finish_reason: FinishReason
    extra: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    """`stats` holds running counters, at least `generated_tokens` and `generation_seconds` (this
    rank's requests, and the wall time during which at least one of them was in flight): the
    trainer's `rollout/tokens_per_s`. Pushed floating-point weights are cast to `dtype`."""

    stats: dict[str, float]
    dtype: torch.dtype
    weight_version: int  # the trainer step whose weights the engine holds (set by the trainer after a push)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...
