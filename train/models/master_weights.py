"""fp32 master weights for a model that one process holds whole and computes in bf16 (one GPU), cast once per
optimizer step.

The module's parameters are bf16: forward and backward read them, and a push sends them as they are (the
engine's dtype, so nothing is cast on the way). AdamW steps fp32 copies of the trainable ones (the masters),
and after each step one multi-tensor copy casts the masters into the bf16 parameters. FSDP2's mixed precision
over one rank does the same arithmetic, but in a Python loop per parameter at every unshard (the forward and
again the backward of every micro-batch) and per gradient after every backward: ~2,000 host ops per micro-batch
at Qwen2.5-0.5B's 290 tensors, and on a GPU each is a kernel launch (benchmarks/README.md, `update_ops.py`).

Per micro-batch `collect` adds the backward's bf16 gradients into fp32 sums (one multi-tensor copy where a sum
starts, one multi-tensor add where it goes on, as FSDP2 accumulates in its reduce dtype) and drops them.
Parameters that got no gradient in a mini-batch get none for the step (AdamW skips them, as it does a gradient
of None), so the update is the one FSDP2 over one rank computes, bit for bit
(tests/integration/test_master_weights_update.py).

Memory per trainable parameter: 2 (bf16) + 4 (master) + 4 (fp32 gradient sum) + 8 (AdamW) bytes, and the
backward's 2-byte gradients until `collect`: 20 at the end of a backward, against FSDP2's 16 plus one layer's
bf16 copy at a time. Frozen parameters: 2 bytes. `state_module` is what checkpoints and the governor's
snapshots hold: the masters under the model's own names, so a checkpoint is the one FSDP2 writes.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from train.utils.typed_config import ConfigError


class MasterModule(torch.nn.Module):
    """The masters under the model's parameter names (a tied weight under each of its names), and the model's
    persistent buffers: what `state_dict`, `load_state_dict`, DCP and the governor see. Loading into it, or
    writing its parameters in place and calling `refresh`, casts the new values into the bf16 model."""

    def __init__(self, refresh) -> None:
        super().__init__()
        self._refresh = refresh

    def place(self, name: str, value: torch.Tensor, parameter: bool) -> None:
        *path, leaf = name.split(".")
        module: torch.nn.Module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        if parameter:
            module.register_parameter(leaf, value)
        else:
            module.register_buffer(leaf, value)

    def refresh(self) -> None:
        """The masters were written in place (a restored snapshot): cast them into the model."""
        self._refresh()


class MasterWeights:
    """The trainable parameters of `model` (fp32, as built) become fp32 masters; the model's own parameters
    become bf16 (`dtype`), frozen ones too. One process holds the whole model (no FSDP, no TP)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        unique: dict[int, torch.nn.Parameter] = {}
        for p in model.parameters():
            unique.setdefault(id(p), p)
        self.compute = [p for p in unique.values() if p.requires_grad]
        with torch.no_grad():
            # the master keeps the fp32 storage the model was loaded into; the model gets a bf16 copy
            self.masters = [torch.nn.Parameter(p.detach(), requires_grad=True) for p in self.compute]
            for p in unique.values():
                p.data = p.detach().to(dtype)
        self._targets = [p.detach() for p in self.compute]  # the bf16 storage `publish` writes
        of = {id(p): m for p, m in zip(self.compute, self.masters)}
        self.state_module = MasterModule(self.publish)
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in of:
                self.state_module.place(name, of[id(p)], parameter=True)
        for name, buffer in model.named_buffers(remove_duplicate=False):
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if leaf not in module._non_persistent_buffers_set:
                self.state_module.place(name, buffer, parameter=False)
        self.state_module.register_load_state_dict_post_hook(lambda module, keys: self.publish())
        # fp32 gradient sums, one flat buffer (allocated at the first collect); which have one this step
        self._sums: list[torch.Tensor] | None = None
        self._started = [False] * len(self.masters)

    @property
    def sums_held(self) -> bool:
        """Whether the fp32 gradient sums are allocated (from the first backward on; they stay, like the moments)."""
        return self._sums is not None

    def _views(self) -> list[torch.Tensor]:
        if not self.masters:  # nothing trains (every weight frozen): nothing to sum
            return []
        if self._sums is None:
            flat = torch.empty(sum(m.numel() for m in self.masters), dtype=torch.float32,
                               device=self.masters[0].device)
            self._sums = [v.view_as(m) for v, m in zip(flat.split([m.numel() for m in self.masters]), self.masters)]
        return self._sums

    @torch.no_grad()
    def collect(self) -> None:
        """After a backward: its bf16 gradients added into the fp32 sums (a sum that starts is a cast copy), and
        dropped from the model."""
        sums = self._views()
        start, start_from, add, add_from = [], [], [], []
        for i, p in enumerate(self.compute):
            grad = p.grad
            if grad is None:
                continue
            if self._started[i]:
                add.append(sums[i])
                add_from.append(grad)
            else:
                start.append(sums[i])
                start_from.append(grad)
                self._started[i] = True
            p.grad = None
        if start:
            torch._foreach_copy_(start, start_from)
        if add:
            torch._foreach_add_(add, add_from)

    def attach(self) -> None:
        """Before the optimizer step: each master's gradient is its sum (None where no backward gave one)."""
        sums = self._views()
        for i, m in enumerate(self.masters):
            m.grad = sums[i] if self._started[i] else None

    def restart(self) -> None:
        """After the optimizer step (which set the masters' gradients to None): the next backward starts new
        sums."""
        self._started = [False] * len(self.masters)

    def discard(self) -> None:
        """The gradients forgotten: for a mini-batch whose optimizer step is not taken."""
        for p in self.compute:
            p.grad = None
        for m in self.masters:
            m.grad = None
        self.restart()

    @torch.no_grad()
    def publish(self) -> None:
        """The masters cast into the model's bf16 parameters: one multi-tensor copy."""
        torch._foreach_copy_(self._targets, self.masters)

    @contextmanager
    def in_model(self) -> Iterator[torch.nn.Module]:
        """The model with its trainable parameters holding the fp32 masters (an export reads them, not their
        bf16 casts; what is written into them stays); bf16 again after, cast from the masters."""
        held = [p.data for p in self.compute]
        try:
            for p, m in zip(self.compute, self.masters):
                p.data = m.detach()
            yield self.model
        finally:
            for p, data in zip(self.compute, held):
                p.data = data
            self.publish()


def master_weights_refusal(key: str, ranks: int, dtype: str, offload_model: bool, vision: bool) -> str | None:
    """Why `{key}.master_weights` cannot apply to this model (None when it can): one process holds the whole
    model and trains it alone (`ranks`: the ranks its layout spans, ddp x fsdp x tp, is 1), computes in bf16, on
    the device, and it is a text model."""
    if dtype != "bfloat16":
        return f"{key}.dtype={dtype} trains the weights themselves (masters are for bf16 compute)"
    if ranks > 1:
        return (f"the model is laid out over {ranks} ranks (FSDP2 shards it, TP splits it, or FSDP2 reduces the "
                "gradients of its ddp replicas); it applies to one process training alone (one GPU)")
    if offload_model:
        return f"{key}.offload_model=true keeps the weights in host memory under FSDP2"
    if vision:
        return ("a vision-language model keeps FSDP2, which also casts each vision block's float inputs (its "
                "rotary tables) to bf16")
    return None


def decide_master_weights(asked: bool | None, key: str, refusal: str | None, default: bool) -> bool:
    """`{key}.master_weights`: false keeps FSDP2's mixed precision; true requires it to apply (a ConfigError says
    why not: the trainer checks it before any model loads, train/trainer/config.py); null takes `default` where
    it applies."""
    if refusal is not None:
        if asked:
            raise ConfigError(f"{key}.master_weights=true cannot apply: {refusal}; set {key}.master_weights=null "
                             "(used where it applies) or false")
        return False
    return default if asked is None else bool(asked)
