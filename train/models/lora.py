"""LoRA adapters (`actor.lora.*`, `critic.lora.*`) on a frozen base, through `peft`.

`apply_lora` injects peft's LoRA layers into the model in place (`inject_adapter_in_model`), so the
model stays the transformers class it was (`model.model.layers`, `logits_to_keep`, tied embeddings
and every parallel plan see what they saw before) and only the adapter matrices require grad: the
optimizer, the clip norm, checkpoints and weight pushes then touch adapters alone.

Names: a targeted projection `...q_proj.weight` becomes `...q_proj.base_layer.weight` (filled from
the base checkpoint, `base_name`) plus `...q_proj.lora_A.default.weight` [r, in] and
`...q_proj.lora_B.default.weight` [out, r] (`is_adapter`). B starts at zero, so the model starts as
the base model; A is drawn from a generator seeded by (seed, name), the same on every rank and every
run, whatever the layout (`FreshAdapters`).

The KL reference is the same module with the adapters switched off (`adapters_disabled`): no second
copy of the weights. The merged weights W + (alpha / r) B A are computed shard by shard for the
export (`merged_state`); `save_adapter` writes the peft folder `PeftModel.from_pretrained` loads.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from train.parallel.weight_sync import unique_state

ADAPTER_NAME = "default"  # peft's name for the one adapter a model holds
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    """`<role>.lora.*` (config/grpo.yaml). rank 0: off."""
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, section) -> "LoraSettings":
        """From a `lora:` config section (train/models/config.py's LoraConfig; None or rank 0: off),
        checked by the config."""
        if section is None or not section.rank:
            return cls()
        return cls(int(section.rank), float(section.alpha), float(section.dropout or 0.0),
                   tuple(str(t) for t in section.target_modules))

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none")


class LoraTargetError(ValueError):
    """`target_modules` names no module of the model, or one LoRA cannot wrap."""


def apply_lora(model: torch.nn.Module, settings: LoraSettings, key: str = "actor.lora.target_modules") -> None:
    """Inject LoRA layers into `model` in place (on the meta device too); every base parameter is frozen."""
    from peft import inject_adapter_in_model

    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = [t for t in settings.target_modules if t not in linear_names]
    if unknown:
        raise LoraTargetError(f"config key '{key}': {unknown} name no linear layer of {type(model).__name__} "
                              f"(it has: {', '.join(sorted(linear_names))})")
    if any(t in ("lm_head", "score") for t in settings.target_modules):
        raise LoraTargetError(f"config key '{key}': LoRA on the output head is not supported (the fused and "
                              "vocabulary-parallel heads read its weight directly); target the projections")
    with torch.random.fork_rng(devices=[]):  # peft draws A's initial values: keep the run's RNG untouched
        inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER_NAME)


def is_adapter(name: str) -> bool:
    """A LoRA matrix's state-dict name."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The base checkpoint's name for a state-dict entry of a LoRA-wrapped model."""
    return name.replace(".base_layer.", ".")


def lora_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def has_lora(model: torch.nn.Module) -> bool:
    return next(lora_modules(model), None) is not None


class FreshAdapters:
    """A stand-in for a checkpoint reader (train/models/model_init.py) that holds the adapters' initial
    values: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with a = sqrt(5), as peft and nn.Linear
    draw it) from a generator seeded by (seed, name), B = 0. Every rank draws the full tensor and keeps
    its piece, so the values do not depend on the layout."""

    def __init__(self, model: torch.nn.Module, seed: int = 0) -> None:
        self.folder = "(fresh LoRA adapters)"
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if is_adapter(k)}
        self.seed = seed

    def keys(self) -> list[str]:
        return list(self.shapes)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        shape = self.shapes[name]
        if ".lora_B." in name:
            full = torch.zeros(shape)
        else:
            digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            bound = 1.0 / math.sqrt(shape[1])
            full = (torch.rand(shape, generator=g) * 2 - 1) * bound
        return full[index].clone() if index is not None else full


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model's forward (the KL reference): every LoRA layer passes its input to the base
    layer alone. peft's enable_adapters(False) would also flip requires_grad on the adapters (and so
    what FSDP and the optimizer see); the flag its forward reads is set directly instead."""
    layers = [m for _, m in lora_modules(model)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, value in zip(layers, before):
            m._disable_adapters = value


def adapter_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters' state-dict entries (what a weight push sends)."""
    for name, value in model.state_dict().items():
        if is_adapter(name):
            yield name, value


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def merged_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state with every LoRA projection merged, W + scaling * B A, under the base names.

    Computed on this rank's shard: FSDP2 splits W [out, in] and B [out, r] over the same rows, so the
    merged rows are W_local + s * B_local A, with only A ([r, in], small) gathered whole. The result
    keeps W's placements, so the export gathers it bucket by bucket like any other tensor. Tensors
    come out in state-dict order, tied ones once."""
    from torch.distributed.tensor import DTensor

    modules = dict(lora_modules(model))
    for name, value in unique_state(model):
        if is_adapter(name):
            continue
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if owner is None or owner not in modules or not name.endswith(".base_layer.weight"):
            yield base_name(name), value
            continue
        module = modules[owner]
        a = _full(module.lora_A[ADAPTER_NAME].weight).float()
        b = module.lora_B[ADAPTER_NAME].weight
        scaling = module.scaling[ADAPTER_NAME]
        if isinstance(value, DTensor):
            if tuple(value.placements) != tuple(b.placements):
                raise ValueError(f"{name}: base and LoRA B are laid out differently ({value.placements} vs "
                                 f"{b.placements}); cannot merge shard by shard")
            local = value.to_local()
            merged = (local.float() + scaling * (b.to_local().float() @ a)).to(local.dtype)
            yield base_name(name), DTensor.from_local(merged, value.device_mesh, value.placements,
                                                      shape=value.shape, stride=value.stride())
        else:
            yield base_name(name), (value.float() + scaling * (b.float() @ a)).to(value.dtype)


def peft_key(name: str) -> str:
    """The name peft's adapter files use for a LoRA matrix: `base_model.model.` + the model's name
    without the adapter's name."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def base_model_of(folder: str) -> str | None:
    """The base model an adapter folder names, or None when `folder` is not a peft adapter."""
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("base_model_name_or_path")
