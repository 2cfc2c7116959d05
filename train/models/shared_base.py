"""The rollout engine's model over the actor's own tensors: a LoRA actor's frozen base, or a full fine-tune's bf16
weights (one model copy per rank).

Why: with LoRA the base model never changes, yet the engine used to load a second copy of it (16 GB
for an 8B model in bf16). When each rank's actor holds the whole base (no FSDP sharding, no tensor
parallelism) the engine can read the very same tensors: its model is built on the meta device from
the actor's config, every base parameter and persistent buffer is then the actor's tensor (the same
storage, no copy), and only its LoRA adapters are its own (B = 0 until the first push, which sends
adapters alone, as without sharing). The engine must never write a borrowed tensor (HFEngine refuses
a push of one and does not move them when it sleeps).

A fully fine-tuned actor on one process in bf16 (`actor.master_weights`, train/models/master_weights.py)
holds bf16 weights that its fp32 masters are cast into after each optimizer step, in place: the engine can
borrow all of them. A push then moves nothing (each pushed tensor is the engine's own storage), and the
engine samples from the new weights as soon as the step has cast them. That needs generation never to overlap
the update (no `rollout.max_staleness`, no `rollout.inflight`) and no governor (which keeps a suspect update
out of the engine: a borrowing engine would already hold it).

When it applies (`share_base_refusal` says why not otherwise): `actor.lora.rank > 0` or a full fine-tune as
above, the `hf` engine in this process (`rollout.ranks=0`), the actor unsharded on each rank (`actor.ddp_size`
equal to the world size, `tp_size=1`), its weights on the device (`actor.offload_model=false`), and the
engine's dtype equal to the dtype the actor keeps what it lends in (`actor.dtype`). `rollout.share_actor_base`:
null = share where it applies, true = require it (a config error names why not), false = never.

Memory per rank, P base parameters and L adapter parameters in the engine's dtype of b bytes:
without sharing the engine holds b·(P + L) beside the actor's b·P; with it, b·L (a full fine-tune: nothing).
"""
from __future__ import annotations

import copy
import os

import torch

from train.models.config import compute_dtype
from train.models.lora import LoraSettings, apply_lora, is_adapter
from train.parallel.layout import layout_sizes

def share_base_refusal(run, world_size: int, device_type: str | None, rollout_ranks: int = 0,
                       actor_masters: bool | None = None, paths=None) -> str | None:
    """Why the engine cannot use the actor's tensors under this run config (`RunConfig`), or None when it
    can. `device_type` None (not known yet) skips the dtype rule; `actor_masters`: whether the built actor holds
    fp32 masters (None: not built yet, its config decides); `paths` (the run's ModelPaths, None: not resolved
    yet): a full fine-tune lends its weights only to an engine of the actor's own model."""
    actor, rollout = run.actor, run.rollout
    if actor.lora.rank <= 0:
        if paths is not None and os.path.realpath(paths.rollout) != os.path.realpath(paths.actor):
            return f"the engine runs {paths.rollout} (rollout.model_name), not the actor's {paths.actor}"
        if actor.dtype != "bfloat16" or actor.master_weights is False or actor_masters is False:
            return ("the actor is fully fine-tuned in fp32 weights (actor.lora.rank=0): an engine borrows a full "
                    "fine-tune's weights only from bf16 weights with fp32 masters (actor.dtype=bfloat16 on one "
                    "process, actor.master_weights)")
        if rollout.max_staleness or rollout.inflight:
            return ("rollout generates while the actor updates (rollout.max_staleness / rollout.inflight): a "
                    "fully fine-tuned actor's weights would change under the engine")
        if run.trainer.governor.enable:
            return ("trainer.governor.enable=true keeps a suspect update out of the engine, which would already "
                    "hold a fully fine-tuned actor's weights it borrows")
    if rollout.engine != "hf":
        return f"rollout.engine={rollout.engine} runs its own weights (only the hf engine runs in this process)"
    if rollout.ranks or rollout_ranks:
        return "rollout.ranks > 0: the engines run on other ranks"
    if actor.offload_model:
        return "actor.offload_model=true keeps the actor's base in host memory"
    training_ranks = world_size - (rollout.ranks or 0)
    sizes = layout_sizes(max(training_ranks, 1), actor.ddp_size, actor.tp_size, actor.sp_size)
    if sizes.fsdp > 1 or sizes.tp > 1:
        return (f"each rank holds 1/{sizes.fsdp * sizes.tp} of the actor's base (FSDP over {sizes.fsdp}, TP over "
                f"{sizes.tp} ranks); set actor.ddp_size={training_ranks} so every rank holds the whole base")
    if device_type is not None:
        engine = compute_dtype(rollout.dtype, device_type)
        if engine != actor.dtype:
            return (f"the engine runs in {engine} (rollout.dtype) and the actor keeps its frozen base in {actor.dtype} "
                    f"(actor.dtype); set rollout.dtype={actor.dtype} (or actor.dtype={engine})")
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _set(model: torch.nn.Module, name: str, value: torch.Tensor, parameter: bool) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if parameter:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def engine_model_over(actor_model: torch.nn.Module, lora: LoraSettings) -> tuple[torch.nn.Module, list[str]]:
    """A causal LM of the actor's class whose base parameters and persistent buffers are the actor's
    tensors (same storage), with LoRA layers of its own: zeros until the first push (without LoRA every
    tensor is the actor's). Returns the model and the names of the tensors it borrows. The actor must hold its
    whole model on this rank."""
    from transformers import AutoModelForCausalLM

    from train.models.checkpoint_names import pretrained_model
    from train.models.model_init import reset_non_persistent_buffers

    pretrained = pretrained_model(actor_model)
    if pretrained is None:
        raise TypeError(f"{type(actor_model).__name__} holds no transformers model to share")
    actor_state = {k: _local(v.detach()) for k, v in actor_model.state_dict().items()}
    base = next(v for k, v in actor_state.items() if not is_adapter(k) and v.is_floating_point())
    # Its own config object, with the attention a loaded model has: the actor's is its packed attention
    # (train/parallel/seq_parallel.py), and the engine switches its own for static decoding.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(pretrained.config), dtype=base.dtype,
                                                 attn_implementation="sdpa")
    if lora.enabled:
        apply_lora(model, lora)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    borrowed = []
    for name, value in model.state_dict(keep_vars=True).items():
        if is_adapter(name):
            _set(model, name, torch.zeros(value.shape, dtype=base.dtype, device=base.device), name in params)
            continue
        source = actor_state.get(name)
        if source is None or tuple(source.shape) != tuple(value.shape):
            raise ValueError(f"the actor has no tensor '{name}' of shape {tuple(value.shape)} to lend the engine "
                             f"(it has {None if source is None else tuple(source.shape)}): is its base sharded?")
        if source.device != base.device:
            raise ValueError(f"the actor's '{name}' is on {source.device}, its base on {base.device}")
        _set(model, name, source, name in params)
        borrowed.append(name)
    for name, buffer in list(model.named_buffers()):  # non-persistent (rotary frequencies): computed again
        if buffer.is_meta:
            _set(model, name, torch.empty_like(buffer, device=base.device), parameter=False)
    reset_non_persistent_buffers(model)
    if getattr(pretrained, "generation_config", None) is not None:  # the folder's EOS ids, as from_pretrained has them
        model.generation_config = copy.deepcopy(pretrained.generation_config)
    model.eval()
    return model, borrowed
