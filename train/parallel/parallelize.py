"""Wrapping a model for its layout, torchtitan style: small composable functions over a device mesh,
applied in order by `parallelize`: `apply_tp` (train/parallel/tensor_parallel.py), `apply_ep`
(routed experts split over ep ranks: train/parallel/expert_parallel.py),
`install_packed_attention` (segment attention over packed rows, Ulysses when sp > 1:
train/parallel/seq_parallel.py), `apply_ac`, `apply_compile`, `apply_fsdp`."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from train.parallel.expert_parallel import apply_ep, expert_modules
from train.parallel.layout import Layout
from train.parallel.seq_parallel import install_packed_attention
from train.parallel.tensor_parallel import apply_tp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks (Llama/Qwen2/Qwen3/Mistral: model.model.layers; a vision-language model's
    language model: model.model.language_model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(getattr(inner, "language_model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at model.model.layers")
    return list(layers)


def vision_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A vision-language model's vision tower blocks (model.model.visual.blocks); [] for a text model."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    return list(getattr(visual, "blocks", []) or [])


def apply_ac(model: torch.nn.Module) -> None:
    """Activation checkpointing per decoder layer (HF's own implementation)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_refusal(tp_size: int) -> str | None:
    """Why a layout cannot compile its layers (None when it can). Under tensor parallelism the compiled layers
    gave wrong gradients for the embeddings (the backward's sum of the layer input's gradient over the tp ranks
    went missing, torch 2.13 on CPU): refused rather than trained wrong."""
    if tp_size > 1:
        return (f"compiled layers under tensor parallelism (tp_size {tp_size}) gave the embeddings wrong gradients "
                "on torch 2.13 (the sum of the layers' input gradient over the tp ranks went missing): lay the model "
                "out with tp_size=1 (FSDP, sp or cp shard it instead) or leave compile off")
    return None


def apply_compile(model: torch.nn.Module) -> int:
    """torch.compile each decoder layer in place (`Module.compile`: the parameters and their state-dict
    names stay, so checkpoints, pushes and FSDP see the same model), so a layer's norms, RoPE, SwiGLU
    and residual adds run as a few fused kernels instead of one kernel each. Layers of one class share
    the compiled code (dynamo guards on what the forward reads, not on which layer runs it); the first
    micro-batch of a new length recompiles once, and from then on the lengths are dynamic. Compiled
    inside activation checkpointing (the recompute replays the compiled forward) and under FSDP2's hooks
    (which dynamo leaves to run eagerly). Returns the number of layers compiled."""
    layers = transformer_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, param_dtype: str = "float32",
               reshard_after_forward: bool = True, offload: bool = False,
               expert_mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """FSDP2: shard each decoder layer, then the root (embeddings, norm, lm_head). A 2-D
    (ddp, fsdp) mesh gives hybrid sharding: replicate over ddp, shard over fsdp. `offload` keeps
    parameters, gradients and the optimizer step on the CPU (CPUOffloadPolicy). With expert
    parallelism, each layer's experts (already split over ep) are their own FSDP unit over
    `expert_mesh`, inside their layer's."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is not None:  # a vision tower: each block its own unit, the rest of the tower (patch embedding, merger) one
        for block in vision_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
        fully_shard(visual, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    for layer in transformer_layers(model):
        if expert_mesh is not None:
            for experts in expert_modules(layer):
                fully_shard(experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                            offload_policy=policy)
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    return model


def parallelize(model: torch.nn.Module, layout: Layout, *, param_dtype: str = "float32",
                gradient_checkpointing: bool = False, offload: bool = False, compile_layers: bool = False,
                plain: bool = False) -> torch.nn.Module:
    """The composition, in the order the pieces require: TP plans on plain modules, packed
    (and, with sp > 1, Ulysses) attention, activation checkpointing, compiled layers (`compile_layers`), then FSDP
    over the (ddp, fsdp) mesh. A single replica without offload (one process) stays a plain module in fp32, or with
    `plain` when the caller holds the precision itself (bf16 weights with fp32 masters,
    train/models/master_weights.py, or a frozen model in bf16): FSDP would shard over one rank and only add its
    hooks, its per-parameter casts and DTensor dispatch to every call."""
    if layout.sizes.tp > 1:
        apply_tp(model, layout.tp_mesh)
    if layout.sizes.ep > 1:
        apply_ep(model, layout.ep_mesh)
    install_packed_attention(model)
    if gradient_checkpointing:
        apply_ac(model)
    if compile_layers:
        why = compile_refusal(layout.sizes.tp)
        if why is not None:
            raise ValueError(why)
        apply_compile(model)
    if layout.fsdp_mesh.size() == 1 and layout.sizes.tp == 1 and (param_dtype == "float32" or plain) and not offload:
        return model
    return apply_fsdp(model, layout.fsdp_mesh, param_dtype=param_dtype, offload=offload,
                      expert_mesh=layout.expert_fsdp_mesh if layout.sizes.ep > 1 else None)
