"""Tensor parallelism for Llama / Qwen2 / Qwen3 style models (DTensor `parallelize_module`), and the
vocab-parallel log-softmax / entropy that keeps the LM head split over the vocabulary.

The plan (Megatron-style with sequence-parallel norms, as in torchtitan):
- embed_tokens: row-wise over the vocabulary, output sharded over the sequence;
- per decoder layer: norms sequence-parallel; attention and MLP inputs all-gathered; q/k/v and
  gate/up column-wise (each rank owns whole heads); o and down row-wise, reduce-scattered back to
  sequence shards; Qwen3's per-head q/k norms run on each rank's own heads;
- final norm sequence-parallel, then gathered, so the trainer can pick the positions it needs;
- lm_head column-wise: each rank holds a slice of the vocabulary and its logits, never the full
  [tokens, vocab] tensor. `vocab_parallel_logprobs` combines the slices with three all-reduces.
Gradients stay exact: replicated parameters (norms) get DTensor's partial-sum reduction, and the
log-softmax's reductions have identity backward because every tp rank computes the same loss.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)


class HeadShardedNorm(ParallelStyle):
    """A norm over head_dim applied to [b, s, heads/tp, head_dim] local heads (Qwen3 q_norm/k_norm):
    the weight is replicated and its gradient summed over the tp ranks."""

    def _apply(self, module: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
        return distribute_module(
            module, mesh,
            input_fn=lambda mod, inputs, m: (DTensor.from_local(inputs[0], m, (Shard(2),), run_check=False),
                                             *inputs[1:]),
            output_fn=lambda mod, out, m: out.to_local())


class ReplicatedLinear(ParallelStyle):
    """A small head every tp rank computes in full on the same input (the critic's value head)."""

    def _apply(self, module: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
        return distribute_module(
            module, mesh,
            input_fn=lambda mod, inputs, m: (DTensor.from_local(inputs[0], m, (Replicate(),), run_check=False),),
            output_fn=lambda mod, out, m: out.to_local())


class VocabParallelHead(ColwiseParallel):
    """The lm_head column-wise over the vocabulary, returning this rank's logits as a tensor of their
    own. `to_local()` returns a view, and FSDP2 warns about a view leaving the root module (an in-place
    op on it would skip its backward hook; we make none). The copy holds only the kept positions'
    logits, and the view's base is freed at once, so the peak memory does not grow."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        local = ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return local.clone()


class _DropUnflattenedMeshNotice(logging.Filter):
    """DTensor's note that a redistribution over the (fsdp, tp) mesh dims runs as one collective per
    dim (the gradient norm for clipping: two all-reduces): correct, only not fused
    (tests/integration/test_distributed.py checks tp=2 and fsdp2xtp2 against one process). Flattening the mesh
    would change the reduction order."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("While redistributing from")
                    and "flatten mesh dimensions" in record.getMessage())


_MESH_NOTICE_FILTER = _DropUnflattenedMeshNotice()


def quiet_harmless_tp_notices() -> None:
    """Once per process that applies TP: the notice above, printed once per rank, is not a problem."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if _MESH_NOTICE_FILTER not in logger.filters:
        logger.addFilter(_MESH_NOTICE_FILTER)


def _layer_plan(layer: torch.nn.Module) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if hasattr(layer.self_attn, "q_norm"):  # Qwen3, Gemma 3
        plan["self_attn.q_norm"] = HeadShardedNorm()
        plan["self_attn.k_norm"] = HeadShardedNorm()
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 2/3: norms on both sides of attention and MLP
        # post_attention / post_feedforward norm a block's output before the residual add: back to local shards
        # (the residual stream is plain tensors); pre_feedforward feeds the MLP as Llama's post_attention does.
        plan["post_attention_layernorm"] = SequenceParallel(use_local_output=True)
        plan["pre_feedforward_layernorm"] = SequenceParallel()
        plan["post_feedforward_layernorm"] = SequenceParallel(use_local_output=True)
    return plan


TP_SUPPORTED = "tensor parallelism supports Llama, Qwen2, Qwen3, Mistral and Gemma 3 style models"
# model types whose layout has no plan here, and why (checked at start-up from config.json: tp_refusal)
_NO_TP_PLAN = {
    "phi3": "its fused qkv_proj and gate_up_proj would split across the q/k/v and gate/up boundaries",
    "olmo2": "its q/k norms span all heads, so a rank holding some heads cannot norm them alone",
}


def expert_count(model_config) -> int:
    """Routed experts per MoE layer from a model's config (the names transformers' families use); 0: dense."""
    return next((int(getattr(model_config, k)) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                 if getattr(model_config, k, None)), 0)


def tp_refusal(model_config) -> str | None:
    """Why this model cannot run under tp_size > 1 (None: it can), from its config alone."""
    kind = getattr(model_config, "model_type", "")
    if kind in _NO_TP_PLAN:
        return f"{TP_SUPPORTED}; {kind}: {_NO_TP_PLAN[kind]}"
    if expert_count(model_config):
        return (f"{TP_SUPPORTED}; {kind}: a mixture of experts, whose experts have no tensor-parallel plan "
                "(shard them with FSDP2 instead)")
    return None


def check_tp_supported(model: torch.nn.Module) -> None:
    """The plan names Llama-family modules; refuse anything else with a clear message."""
    reason = tp_refusal(getattr(model, "config", None))
    backbone = getattr(model, "model", model)
    layers = getattr(backbone, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers else None
    mlp = getattr(layers[0], "mlp", None) if layers else None
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if reason is None and (attn is None or mlp is None or not all(hasattr(attn, n) for n in names)
                           or not hasattr(mlp, "gate_proj") or not hasattr(layers[0], "input_layernorm")):
        reason = f"{TP_SUPPORTED} (q/k/v/o_proj, gate/up/down_proj); {type(model).__name__} is not one"
    if reason is not None:
        raise ValueError(f"{reason}: set tp_size=1")


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """Parallelize a causal LM (`model.model` + `lm_head`) or a backbone with a `value_head` in place."""
    check_tp_supported(model)
    quiet_harmless_tp_notices()
    backbone = model.model
    parallelize_module(backbone, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    })
    # The final norm's output goes back to whole rows (plain tensors) for position selection.
    parallelize_module(backbone.norm, tp_mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
    for layer in backbone.layers:
        parallelize_module(layer, tp_mesh, _layer_plan(layer))
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        tied = lm_head.weight is backbone.embed_tokens.weight or getattr(model.config, "tie_word_embeddings", False)
        parallelize_module(model, tp_mesh, {"lm_head": VocabParallelHead(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True)})
        if tied:  # both shard the vocabulary on dim 0: the same DTensor parameter again
            model.lm_head.weight = backbone.embed_tokens.weight
    if hasattr(model, "value_head"):
        parallelize_module(model.value_head, tp_mesh, ReplicatedLinear())
    return model


class _SumNoBackward(torch.autograd.Function):
    """All-reduce sum whose backward is the identity: the reduced value feeds a loss that every tp
    rank computes identically, so each rank's local input receives that same gradient once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None


def vocab_parallel_logprobs(local_logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup,
                            temperature: float = 1.0, with_entropy: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and (optionally) entropy from [k, V/tp] logit slices (rank r holds vocabulary
    ids [r*V/tp, (r+1)*V/tp)); both [k], equal on every rank of the group."""
    z = local_logits.float()
    if temperature != 1.0:
        z = z / temperature
    part = z.shape[-1]
    start = dist.get_rank(group) * part
    m = z.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # a shift for stability; it cancels exactly
    e = torch.exp(z - m[:, None])
    total = _SumNoBackward.apply(e.sum(-1), group)
    log_z = m + torch.log(total)
    local = labels - start
    inside = (local >= 0) & (local < part)
    picked = z.gather(-1, local.clamp(0, part - 1)[:, None]).squeeze(-1) * inside
    logp = _SumNoBackward.apply(picked, group) - log_z
    entropy = None
    if with_entropy:  # H = log Z - E_p[z]
        expected = _SumNoBackward.apply((e * z).sum(-1), group) / total
        entropy = log_z - expected
    return logp, entropy
