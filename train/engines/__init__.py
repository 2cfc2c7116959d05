"""Rollout engines behind one interface (`train.engines.base.RolloutEngine`).

`make_engine("hf", ...)` works everywhere. `make_engine("sglang", ...)` imports
`train.engines.sglang` only when asked for, so this package imports without SGLang installed.
"""
from __future__ import annotations

from typing import Any

from train.engines.base import Generation, RolloutEngine, SamplingParams

ENGINE_NAMES = ("hf", "sglang")

__all__ = ["ENGINE_NAMES", "Generation", "RolloutEngine", "SamplingParams", "engine_sampling_keys", "make_engine"]


def engine_sampling_keys(name: str) -> tuple[str, ...]:
    """Sampling parameters an engine takes beyond the common set (`SamplingParams` fields)."""
    if name == "sglang":
        from train.engines.sglang import SGLANG_SAMPLING_KEYS  # importable without SGLang

        return SGLANG_SAMPLING_KEYS
    return ()


def make_engine(name: str, *args: Any, **kwargs: Any) -> RolloutEngine:
    """Build a rollout engine by name.

    - `"hf"`: `make_engine("hf", path=dir, **kw)` loads a checkpoint with
      `HFEngine.from_pretrained(dir, **kw)`; otherwise the arguments go to
      `HFEngine(model, tokenizer, *, eos_token_ids, ...)`.
    - `"sglang"`: the arguments go to `train.engines.sglang.SGLangEngine`.
    """
    if name == "hf":
        from train.engines.hf import HFEngine

        if "path" in kwargs:
            return HFEngine.from_pretrained(kwargs.pop("path"), *args, **kwargs)
        return HFEngine(*args, **kwargs)
    if name == "sglang":
        from train.engines.sglang import SGLangEngine  # optional extra: import only on demand

        return SGLangEngine(*args, **kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
