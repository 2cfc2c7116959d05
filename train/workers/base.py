"""Loading a Hugging Face causal LM and wrapping it for training, torchtitan style: small
composable functions over a device mesh (`apply_ac`, `apply_fsdp`), TP/SP plans slot in beside them."""
from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModel, AutoModelForCausalLM

from train.utils.batching import MicroBatch, build_micro_batch, plan_micro_batches
from train.utils.distributed import DistContext, all_reduce_max

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_causal_lm(path: str, dtype: str = "float32", device: torch.device | str = "cpu") -> torch.nn.Module:
    # Parameters stay fp32 for the optimizer; bf16 compute comes from FSDP's mixed precision.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device)


class ValueModel(torch.nn.Module):
    """The critic: the actor's architecture without its LM head, and a linear value head over the
    final hidden state. `model.model.layers` is where FSDP / AC find the decoder blocks, as for the actor."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.model = backbone
        self.config = backbone.config
        self.value_head = torch.nn.Linear(backbone.config.hidden_size, 1)
        # A zero head: V = 0 at the start, the same on every rank and run (no RNG drawn).
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        # [b, L]: V of the state ending at each position (a copy, not a view: FSDP hooks the output)
        return self.value_head(hidden).squeeze(-1).clone()

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


def load_value_model(path: str, device: torch.device | str = "cpu") -> ValueModel:
    """A causal LM folder's backbone (its LM head is not loaded) plus a fresh value head."""
    backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
    return ValueModel(backbone).to(device)


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


def padded_micro_batches(index: list[int], ids: list[list[int]], masks: list[list[int]], max_tokens: int,
                         pad_id: int, ctx: DistContext) -> list[MicroBatch]:
    """This rank's samples `index` as micro-batches under a token budget, padded with empty
    micro-batches to the busiest rank's count: FSDP collectives need every rank to run as many forwards."""
    plan = [[index[j] for j in g] for g in plan_micro_batches([len(ids[i]) for i in index], max_tokens)]
    n = int(all_reduce_max(len(plan), ctx.device))
    plan += [[] for _ in range(n - len(plan))]
    return [build_micro_batch(g, ids, masks, pad_id, ctx.device) for g in plan]


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler, max_norm: float) -> float:
    """Global gradient clipping, then the optimizer step unless the norm is not finite; returns the
    pre-clip norm. clip_grad_norm_ over DTensor grads reduces across all shards: a global norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if torch.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return float(norm)
