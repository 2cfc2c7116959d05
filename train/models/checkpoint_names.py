"""A checkpoint in the Hub's key layout, read under the model's own parameter names.

transformers 5 keeps some tensors fused in memory that checkpoints store apart: a mixture-of-experts
layer holds one `experts.gate_up_proj` [experts, 2 x intermediate, hidden] where Qwen3-MoE's files hold
`experts.<e>.gate_proj.weight` and `experts.<e>.up_proj.weight` per expert (Mixtral's, under
`block_sparse_moe.experts.<e>.w1/w3`). `from_pretrained` converts with the model's conversion mapping
(transformers.conversion_mapping); this reader applies the same mapping (its renamings, and converters
made of MergeModulelist over experts then Concatenate) to the names, and builds each fused tensor on
demand from just the experts a rank holds: reading a shard of a fused tensor reads the files' tensors
of its experts only, so memory per rank still falls with the ranks. A converter with other operations
is refused with the model type and the operation named.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch


class CheckpointLayoutError(ValueError):
    """A checkpoint whose key layout this loader cannot map onto the model."""


@dataclass(frozen=True)
class Fused:
    """One model tensor built from checkpoint tensors: parts[j][e] is expert e's tensor of the converter's j-th
    source pattern. The experts are stacked on dim 0, then the patterns concatenated on `cat_dim` (if any)."""
    parts: tuple[tuple[str, ...], ...]
    cat_dim: int | None


def _expert_index(pattern: str, key: str) -> int:
    """The number the pattern's `*` stands for in `key` (the expert's index)."""
    regex = re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)")
    found = re.search(regex, key)
    if found is None or not found.groups():
        raise CheckpointLayoutError(f"cannot find the expert index of '{key}' with the pattern '{pattern}'")
    return int(found.group(1))


def _fused_layout(converter, model_type: str) -> int | None:
    """The concatenation dim of a converter made of MergeModulelist(dim=0) [+ Concatenate(dim=d)]; refuses others."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    names = [type(op).__name__ for op in ops]
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0 or len(ops) > 2 or \
            (len(ops) == 2 and not isinstance(ops[1], Concatenate)):
        raise CheckpointLayoutError(f"{model_type}: its checkpoint layout needs the conversion {names} for "
                                    f"{converter.target_patterns}, which this loader does not build (it builds "
                                    "experts stacked by MergeModulelist(dim=0), optionally then Concatenate)")
    return ops[1].dim if len(ops) == 2 else None


class ConvertedReader:
    """A WeightReader (train/models/model_init.py) seen under the model's names: plain renamed tensors and fused
    expert tensors built from their per-expert parts."""

    def __init__(self, reader, model: torch.nn.Module, transforms: list | None = None) -> None:
        """`transforms`: the model's conversions (`conversions_of`), taken before FSDP wraps it (FSDP renames the
        classes transformers looks them up by); None: taken from `model` now."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.folder = reader.folder
        self._reader = reader
        pretrained = pretrained_model(model)
        if transforms is None:
            transforms = conversions_of(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        model_type = getattr(getattr(pretrained, "config", None), "model_type", "?")
        self._plain: dict[str, str] = {}
        collected: dict[str, tuple[object, dict[str, dict[int, str]]]] = {}
        for key in reader.keys():
            renamed = key
            for renaming in renamings:  # every renaming in turn, as from_pretrained does (transformers 5.17+)
                renamed, _ = renaming.rename_source_key(renamed)
            for converter in converters:
                target, pattern = converter.rename_source_key(renamed)
                if pattern is not None:
                    _, by_pattern = collected.setdefault(target, (converter, {}))
                    by_pattern.setdefault(pattern, {})[_expert_index(pattern, renamed)] = key
                    break
            else:
                self._plain[renamed] = key
        self._fused: dict[str, Fused] = {}
        for target, (converter, by_pattern) in collected.items():
            cat_dim = _fused_layout(converter, model_type)
            parts = []
            for pattern in converter.source_patterns:  # in the converter's order (gate before up)
                experts = by_pattern.get(pattern, {})
                if sorted(experts) != list(range(len(experts))) or not experts:
                    raise CheckpointLayoutError(f"{self.folder}: '{target}' needs experts 0..n-1 of '{pattern}', the "
                                                f"checkpoint has {sorted(experts)}")
                parts.append(tuple(experts[e] for e in range(len(experts))))
            self._fused[target] = Fused(tuple(parts), cat_dim)

    def keys(self) -> list[str]:
        return [*self._plain, *self._fused]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The model's tensor `name`, or just its block `index` (one slice per dim)."""
        if name in self._plain:
            return self._reader.read(self._plain[name], index)
        fused = self._fused[name]
        experts = range(len(fused.parts[0]))
        chosen = experts[index[0]] if index is not None else experts
        stacked = [self._expert(fused, e) for e in chosen]  # only the experts of this block are read
        if not stacked:  # a rank holding none of its experts: an empty block of the right shape
            first = self._expert(fused, 0)
            return first.new_empty((0, *first.shape))
        out = torch.stack(stacked)
        return out[(slice(None), *index[1:])] if index is not None else out

    def _expert(self, fused: Fused, e: int) -> torch.Tensor:
        """Expert e's slice of a fused tensor: its part of each source pattern, concatenated."""
        pieces = [self._reader.read(part[e]) for part in fused.parts]
        return torch.cat(pieces, dim=fused.cat_dim - 1) if fused.cat_dim is not None else pieces[0]


def conversions_of(model: torch.nn.Module) -> list:
    """transformers' key conversions (Hub layout -> the model's names) for `model`, an unwrapped model: FSDP2
    renames each class it wraps (FSDPQwen2_5_VLForConditionalGeneration), and transformers finds a family's
    renamings (Qwen2.5-VL: model.layers -> model.language_model.layers, visual -> model.visual) by class name."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    pretrained = pretrained_model(model)
    return get_model_conversion_mapping(pretrained) if pretrained is not None else []


def pretrained_model(model: torch.nn.Module):
    """The transformers PreTrainedModel in `model` (itself, or the backbone a critic wraps); None if there is none."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def hub_layout(model: torch.nn.Module):
    """A function (name, full tensor) -> [(name, tensor), ...] in the Hub's key layout, the reverse of the reader
    above: a fused expert tensor becomes its per-expert tensors under the files' names (transformers'
    `revert_weight_conversion`, which `save_pretrained` applies), so an export loads wherever the Hub's
    checkpoints do (vLLM, SGLang, `from_pretrained`). Each fused tensor is split on its own: the export streams
    tensor by tensor. Models without a conversion keep their names (the function returns them as they are)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import revert_weight_conversion

    pretrained = pretrained_model(model)
    if pretrained is None or not get_model_conversion_mapping(pretrained, add_legacy=False):
        return lambda name, tensor: [(name, tensor)]

    def to_hub(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return list(revert_weight_conversion(pretrained, {name: tensor}).items())

    return to_hub
