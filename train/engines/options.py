"""Engine constructor arguments from the `rollout:` config section (one place, for the trainer)."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

# Defaults for keys a config written before they existed may lack (config/grpo.yaml has them all).
DEFAULTS = {"tp_size": 1, "gpu_memory_utilization": 0.5, "bucket_size_mb": 512, "base_port": 30000,
            "dtype": None, "sglang_kwargs": None, "offload_weights": False}


def _get(rollout: DictConfig, key: str) -> Any:
    value = OmegaConf.select(rollout, key, default=DEFAULTS.get(key))
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def engine_kwargs(rollout: DictConfig, ctx: Any, *, model_path: str, tokenizer: Any, seed: int) -> dict[str, Any]:
    """Keyword arguments for `make_engine(rollout.engine, **kwargs)`; `ctx` is the DistContext."""
    if rollout.engine == "sglang":
        return {
            "model_path": model_path,
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "local_rank": ctx.local_rank,
            "local_world_size": ctx.local_world_size,
            "tp_size": _get(rollout, "tp_size"),
            "gpu_memory_utilization": _get(rollout, "gpu_memory_utilization"),
            "base_port": _get(rollout, "base_port"),
            "bucket_size_mb": _get(rollout, "bucket_size_mb"),
            "dtype": _get(rollout, "dtype") or "bfloat16",
            "seed": seed,
            "offload_weights": bool(_get(rollout, "offload_weights")),
            "engine_kwargs": _get(rollout, "sglang_kwargs") or None,
        }
    return {
        "path": model_path,
        "tokenizer": tokenizer,
        "device": ctx.device,
        "dtype": _get(rollout, "dtype"),  # None: bfloat16 on CUDA, float32 on CPU
        "max_batch_size": rollout.max_batch_size,
        "seed": seed + ctx.rank,
    }
