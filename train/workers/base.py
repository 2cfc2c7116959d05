"""Loading a Hugging Face causal LM and wrapping it for training, torchtitan style: small
composable functions over a device mesh (`apply_ac`, `apply_fsdp`), TP/SP plans slot in beside them."""
from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_causal_lm(path: str, dtype: str = "float32", device: torch.device | str = "cpu") -> torch.nn.Module:
    # Parameters stay fp32 for the optimizer; bf16 compute comes from FSDP's mixed precision.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device)


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks (Llama/Qwen2/Qwen3/Mistral: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at model.model.layers")
    return list(layers)


def apply_ac(model: torch.nn.Module) -> None:
    """Activation checkpointing per decoder layer (HF's own implementation)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, param_dtype: str = "float32",
               reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2: shard each decoder layer, then the root (embeddings, norm, lm_head)."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    for layer in transformer_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


def build_optimizer(model: torch.nn.Module, lr: float, betas, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, total_updates: int, warmup_ratio: float,
                    kind: str, min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then constant or cosine down to `min_lr_ratio` of the peak."""
    warmup = int(round(warmup_ratio * total_updates))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_updates - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def full_named_tensors(model: torch.nn.Module):
    """(name, full tensor) for every state-dict entry; DTensor shards are all-gathered, so every
    rank must iterate this in the same order."""
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        yield name, value.detach()
