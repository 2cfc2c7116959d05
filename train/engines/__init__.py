"""Rollout engines behind one interface (`train.engines.base.RolloutEngine`).

The trainer and the rollout ranks call `build_engine(cfg.rollout, ctx, model_path=..., tokenizer=...,
seed=...)`: the engine the `rollout:` section names, with its keyword arguments from that section
(`engine_kwargs`). Underneath, `make_engine(name, ...)` builds one by name: `"hf"` works everywhere;
`"sglang"` imports `train.engines.sglang` only when asked for, so this package imports without
SGLang installed.
"""
from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from train.engines.base import Generation, RolloutEngine, SamplingParams

ENGINE_NAMES = ("hf", "sglang")

__all__ = ["ENGINE_NAMES", "Generation", "RolloutEngine", "SamplingParams", "build_engine", "engine_kwargs",
           "engine_sampling_keys", "make_engine"]


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


def engine_kwargs(rollout: Any, ctx: Any, *, model_path: str, tokenizer: Any, seed: int,
                  lora: Any = None) -> dict[str, Any]:
    """Keyword arguments for `make_engine(rollout.engine, **kwargs)` from the `rollout:` config
    section (every key is in config/grpo.yaml); `ctx` is the DistContext."""
    if rollout.engine == "sglang":
        extra = rollout.sglang_kwargs
        return {
            "model_path": model_path,
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "local_rank": ctx.local_rank,
            "local_world_size": ctx.local_world_size,
            "tp_size": rollout.tp_size,
            "gpu_memory_utilization": rollout.gpu_memory_utilization,
            "base_port": rollout.base_port,
            "bucket_size_mb": rollout.bucket_size_mb,
            "dtype": rollout.dtype or "bfloat16",
            "seed": seed,
            "offload_weights": bool(rollout.offload_weights),
            "engine_kwargs": (OmegaConf.to_container(extra, resolve=True) if OmegaConf.is_config(extra)
                              else dict(extra)) if extra else None,
            "lora": lora,
        }
    return {
        "path": model_path,
        "tokenizer": tokenizer,
        "device": ctx.device,
        "dtype": rollout.dtype,  # None: bfloat16 on CUDA, float32 on CPU
        "max_batch_size": rollout.max_batch_size,
        "static_cache": rollout.static_cache,  # None: on CUDA (train/engines/static_decode.py)
        "compile_decode": rollout.compile_decode,  # None: on CUDA with the static cache
        "compile_scope": rollout.compile_decode_scope,  # modules | layers
        "prefill_chunk": rollout.prefill_chunk,  # None: a prompt's prefill in one forward
        "seed": seed + ctx.rank,
        "lora": lora,  # the actor's LoRA layers (None: a full model); pushes then send adapters only
    }


def build_engine(rollout: Any, ctx: Any, *, model_path: str, tokenizer: Any, seed: int,
                 lora: Any = None, model: Any = None, borrowed: tuple[str, ...] = (),
                 record_routing: bool = False) -> RolloutEngine:
    """The rollout engine a run's config asks for, on this rank: `rollout` is the rollout section
    (train/workers/config.py's RolloutConfig); `lora` (LoraSettings): the actor's adapters, which the
    engine holds in the same form. `model` (hf only): a model built already, e.g. over the actor's own
    base tensors (train/models/shared_base.py), whose `borrowed` tensors the engine never writes.
    `record_routing` (hf only; actor.router_replay): each generation carries its MoE routing."""
    kwargs = engine_kwargs(rollout, ctx, model_path=model_path, tokenizer=tokenizer, seed=seed, lora=lora)
    if record_routing:
        if rollout.engine != "hf":
            raise ValueError(f"actor.router_replay needs rollout.engine=hf, which records each token's experts; "
                             f"rollout.engine={rollout.engine} does not (set actor.router_replay=null)")
        kwargs["record_routing"] = True
    if model is None:
        return make_engine(rollout.engine, **kwargs)
    from train.engines.hf import default_eos_token_ids

    for key in ("path", "dtype", "lora"):  # the model is built: its weights, dtype and adapters are set
        kwargs.pop(key)
    return make_engine("hf", model, eos_token_ids=default_eos_token_ids(model, tokenizer), copy_model=False,
                       borrowed=borrowed, **kwargs)
