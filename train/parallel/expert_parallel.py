"""Expert parallelism (`actor.ep_size`): each rank of an ep group holds E / ep of every MoE layer's routed
experts, and each token's hidden state travels to the ranks holding its top-k experts and back by
all-to-all (DeepSpeed-MoE / torchtitan style, dropless: no capacity factor, no token is cut).

Where it sits: ep ranks are data-parallel ranks (they hold different tokens), carved out of the fsdp
dimension: the model mesh is (ddp, efsdp, ep, tp) and fsdp = efsdp x ep, flattened, shards the dense
parameters as before (train/parallel/layout.py). A layer's experts are DTensors sharded on dim 0 over `ep`
(global shape [E, ...]: checkpoints, weight pushes and exports see whole tensors), and FSDP2 shards each
rank's block again over (ddp, efsdp) (train/parallel/parallelize.py).

Per MoE layer and pass, forward: one all-to-all of E counts, one of the T·k routed hidden rows out and one
back; the backward the same two row exchanges in reverse. Bytes per rank per layer: 2 · T·k · hidden ·
dtype size each way, whatever ep is; expert memory per rank falls as 1 / (ep · efsdp).

Gradients: a rank's experts see the tokens of every ep rank, and FSDP averages their gradients over
ddp · efsdp ranks, where dense weights are averaged over ddp · fsdp (the loss carries x ddp · fsdp,
train/models/trainable.py): the expert weights' gradient is divided by ep on the way, so both are the
gradient of the global loss (tests/integration/test_expert_parallel.py against one process).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor


class _AllToAll(torch.autograd.Function):
    """Rows to ranks (`send` rows per rank, `recv` rows per rank); the backward sends the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by `factor` (an expert weight's 1 / ep)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad * ctx.factor, None


# -- each expert class's math, on rows grouped by local expert -------------------------------------------
# rule(module, rows, counts, weights) -> outputs: `rows` [n, hidden] hold counts[e] rows for local expert e in
# turn, `weights` the module's parameters' local blocks by name. Each rule is its class's forward for one
# expert (tests/unit/test_expert_parallel.py checks it against the class's own forward).
ExpertRule = Callable[[torch.nn.Module, torch.Tensor, list[int], dict[str, torch.Tensor]], torch.Tensor]


def _fused_swiglu(module: torch.nn.Module, rows: torch.Tensor, counts: list[int],
                  w: dict[str, torch.Tensor]) -> torch.Tensor:
    """gate_up_proj [E, 2I, H] (gate then up), down_proj [E, H, I], module.act_fn: Qwen3-MoE, Qwen2-MoE,
    OLMoE, Mixtral."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(rows[start:start + n], w["gate_up_proj"][e]).chunk(2, dim=-1)
            outs.append(F.linear(module.act_fn(gate) * up, w["down_proj"][e]))
        start += n
    return torch.cat(outs) if outs else rows.new_zeros((0, w["down_proj"].shape[1]))


def _gpt_oss(module: torch.nn.Module, rows: torch.Tensor, counts: list[int], w: dict[str, torch.Tensor]) -> torch.Tensor:
    """gate_up_proj [E, H, 2I] (gate and up interleaved) and down_proj [E, I, H], both with biases, and the
    clamped GLU of the module's `_apply_gate`: GPT-OSS."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate_up = rows[start:start + n] @ w["gate_up_proj"][e] + w["gate_up_proj_bias"][e]
            outs.append(module._apply_gate(gate_up) @ w["down_proj"][e] + w["down_proj_bias"][e])
        start += n
    return torch.cat(outs) if outs else rows.new_zeros((0, w["down_proj"].shape[2]))


EXPERT_RULES: dict[str, ExpertRule] = {
    "Qwen3MoeExperts": _fused_swiglu, "Qwen2MoeExperts": _fused_swiglu, "OlmoeExperts": _fused_swiglu,
    "MixtralExperts": _fused_swiglu, "GptOssExperts": _gpt_oss,
}


def _rule_name(module: torch.nn.Module) -> str | None:
    """The EXPERT_RULES key of a module (FSDP2 subclasses the module's class: look through the MRO)."""
    return next((c.__name__ for c in type(module).__mro__ if c.__name__ in EXPERT_RULES), None)


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The fused routed-expert modules of a model (one per MoE layer), in layer order."""
    return [m for m in model.modules() if _rule_name(m) is not None]


def ep_refusal(model_config) -> str | None:
    """Why expert parallelism cannot run on this architecture (None: it can), from its config alone."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
    except Exception as e:  # noqa: BLE001 - an architecture transformers cannot build: say so
        return f"cannot build {type(model_config).__name__} to find its experts: {e}"
    experts = [m for m in model.modules() if "Experts" in type(m).__name__ and any(p.dim() == 3 for p in m.parameters())]
    unknown = sorted({type(m).__name__ for m in experts if _rule_name(m) is None})
    if unknown:
        return (f"expert parallelism knows the experts of {', '.join(sorted(EXPERT_RULES))}; "
                f"{', '.join(unknown)} is not one")
    if not experts:
        return f"{type(model_config).__name__} has no fused routed experts to spread"
    return None


def _exchange_counts(per_expert: torch.Tensor, ep: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's rows per expert [E] -> the rows each ep rank sends to each of my experts [ep, E / ep]."""
    got = torch.empty_like(per_expert)
    dist.all_to_all_single(got, per_expert, group=group)
    return got.view(ep, -1)


def ep_forward(module: torch.nn.Module, rule: ExpertRule, ep: int, group: dist.ProcessGroup,
               hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """What the experts module returns ([T, hidden]: each token's routing-weighted sum of its top-k experts'
    outputs), with this rank holding experts [rank · E/ep, (rank + 1) · E/ep) of the module's E.

    Each (token, slot) pair is sent to its expert's rank in expert order, computed there, sent back, weighted,
    and added per token in expert order (as the module's own loop adds them)."""
    weights = {name: _ScaleGrad.apply(p.to_local(), 1.0 / ep) for name, p in module.named_parameters(recurse=False)}
    local_experts = next(iter(weights.values())).shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs in expert order, hence in owner-rank order
    token = order // top_k_index.shape[1]
    per_expert = torch.bincount(flat, minlength=local_experts * ep)
    incoming = _exchange_counts(per_expert, ep, group)  # [source rank, my expert]
    send = per_expert.view(ep, -1).sum(1).tolist()
    recv = incoming.sum(1).tolist()  # one host sync per layer: the all-to-all needs its split sizes
    rows = _AllToAll.apply(hidden_states[token], recv, send, group)  # grouped by (source rank, my expert)
    # regroup by my expert (then source rank) for the rule, and back
    expert_of_row = torch.repeat_interleave(torch.arange(local_experts, device=flat.device).repeat(ep),
                                            incoming.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    counts = incoming.sum(0).tolist()
    out = rule(module, rows[by_expert], counts, weights)
    if not rows.shape[0]:
        # No row came for my experts. Keep both exchanges and the weights in the graph all the same: every
        # rank's backward must run the same collectives in the same order (the all-to-alls, and FSDP's
        # reduce-scatter of the experts, which skips weights without a gradient), or the ranks wait forever.
        out = out + (rows.sum() + sum(w.sum() for w in weights.values())) * 0.0
    back = torch.empty_like(out).index_copy(0, by_expert, out) if out.shape[0] else out
    back = _AllToAll.apply(back, send, recv, group)  # [T·k, hidden] in `order`
    weighted = back * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))


def apply_ep(model: torch.nn.Module, ep_mesh: DeviceMesh) -> int:
    """Shard every fused expert module of `model` (on the meta device or not) on dim 0 over `ep_mesh` and
    route its tokens by all-to-all; returns the number of modules. Refuses a model with none, or with experts
    that do not split evenly."""
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    modules = expert_modules(model)
    if not modules:
        raise ValueError(f"expert parallelism: {type(model).__name__} has no fused routed experts "
                         f"(known: {', '.join(sorted(EXPERT_RULES))}); set ep_size=1")
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % ep:
                raise ValueError(f"expert parallelism: {param.shape[0]} experts do not split over ep_size={ep}")
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.forward = functools.partial(ep_forward, module, EXPERT_RULES[_rule_name(module)], ep, group)
    return len(modules)
