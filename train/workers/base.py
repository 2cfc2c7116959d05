"""Loading a Hugging Face causal LM and wrapping it for training, torchtitan style: small
composable functions over a device mesh, applied in order by `parallelize`:
`apply_tp` (train/utils/tensor_parallel.py), `install_packed_attention` (segment attention over
packed rows, Ulysses when sp > 1: train/utils/seq_parallel.py), `apply_ac`, `apply_fsdp`."""
from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import AutoModel, AutoModelForCausalLM

from train.utils.dispatch import Dispatch
from train.utils.distributed import all_reduce_max
from train.utils.packing import PackedMicroBatch, build_packed, plan_packs
from train.utils.parallel import Layout
from train.utils.seq_parallel import install_packed_attention
from train.utils.tensor_parallel import apply_tp

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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                            **kwargs).last_hidden_state
        # [b, L]: V of the state ending at each position (a copy, not a view: FSDP hooks the output)
        return self.value_head(hidden).squeeze(-1).clone()

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)


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
               reshard_after_forward: bool = True, offload: bool = False) -> torch.nn.Module:
    """FSDP2: shard each decoder layer, then the root (embeddings, norm, lm_head). A 2-D
    (ddp, fsdp) mesh gives hybrid sharding: replicate over ddp, shard over fsdp. `offload` keeps
    parameters, gradients and the optimizer step on the CPU (CPUOffloadPolicy)."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for layer in transformer_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    return model


def parallelize(model: torch.nn.Module, layout: Layout, *, param_dtype: str = "float32",
                gradient_checkpointing: bool = False, offload: bool = False) -> torch.nn.Module:
    """The composition, in the order the pieces require: TP plans on plain modules, packed
    (and, with sp > 1, Ulysses) attention, activation checkpointing, then FSDP over the (ddp, fsdp) mesh."""
    if layout.sizes.tp > 1:
        apply_tp(model, layout.tp_mesh)
    install_packed_attention(model)
    if gradient_checkpointing:
        apply_ac(model)
    return apply_fsdp(model, layout.fsdp_mesh, param_dtype=param_dtype, offload=offload)


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


def packed_micro_batches(index: list[int], ids: list[list[int]], masks: list[list[int]], max_tokens: int,
                         pad_id: int, layout: Layout, device: torch.device) -> list[PackedMicroBatch]:
    """Samples `index` packed into micro-batches of at most `max_tokens` per device (x sp: each
    sp rank holds a 1/sp chunk), padded with empty packs to the busiest rank's count: FSDP
    collectives need every rank to run as many forwards."""
    sp, tp = layout.sizes.sp, layout.sizes.tp
    plan = [[index[j] for j in p] for p in plan_packs([len(ids[i]) for i in index], max_tokens * sp)] if index else []
    n = int(all_reduce_max(len(plan), device))
    plan += [[] for _ in range(n - len(plan))]
    return [build_packed(p, ids, masks, pad_id, device, sp_rank=layout.sp_rank, sp_size=sp, multiple=sp * tp)
            for p in plan]


def token_lists(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [t.long().tolist() for t in tensors]


def per_sample_pass(ids: list[list[int]], masks: list[list[int]], layout: Layout, device: torch.device,
                    micro_batches, forward) -> list[torch.Tensor]:
    """A no-grad pass over this rank's own sequences: spread them over dp groups, run
    `forward(mb) -> [samples, longest - 1]` over `micro_batches(index, ids, masks)`, and return one
    [len-1] CPU tensor per own sequence."""
    dispatch = Dispatch([len(x) for x in ids], layout, device)
    got = dispatch.scatter({"ids": [torch.tensor(x) for x in ids], "mask": [torch.tensor(m) for m in masks]})
    g_ids, g_masks = token_lists(got["ids"]), token_lists(got["mask"])
    out: list[torch.Tensor | None] = [None] * len(g_ids)
    for mb in micro_batches(list(range(len(g_ids))), g_ids, g_masks):
        values = forward(mb)
        for row, i in enumerate(mb.index):
            out[i] = values[row, : len(g_ids[i]) - 1].cpu()
    return dispatch.gather(out)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """`offload_optimizer`: Adam moments live on the CPU between steps and visit the device only
    for the step (a no-op when the device is the CPU)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler, max_norm: float,
                  offload_optimizer: bool = False) -> float:
    """Global gradient clipping, then the optimizer step unless the norm is not finite; returns the
    pre-clip norm. clip_grad_norm_ over DTensor grads reduces across all shards: a global norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if torch.isfinite(norm):
        if offload_optimizer:
            move_optimizer_state(optimizer, norm.device)
        optimizer.step()
        if offload_optimizer:
            move_optimizer_state(optimizer, "cpu")
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return float(norm)
