"""The Hugging Face export (`latest/`), streamed: full tensors are gathered a bucket at a time
(train/parallel/weight_sync.py) and rank 0 writes them into safetensors shards of at most
`shard_bytes`, with `model.safetensors.index.json` when there are several. No process ever holds
more than one shard and one bucket of the model. The folder is written as `<out>.tmp` and renamed.

The critic (PPO) goes to `critic/` as a token-classification model with one label: its backbone,
and the value head as `score` (`AutoModelForTokenClassification.from_pretrained(latest/critic)`
gives the values as `logits[..., 0]`; the critic can resume from that folder too).

A LoRA model (train/models/lora.py) is exported merged (W + (alpha / r) B A, computed shard by
shard), so `latest/` loads like any model, and its adapters alone go to `latest/adapter/` as a peft
folder (`PeftModel.from_pretrained(base, latest/adapter)`; `python -m train.serve` serves it too).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import torch

from train.models.checkpoint_names import hub_layout
from train.models.lora import ADAPTER_NAME, adapter_state, has_lora, merged_state, peft_key
from train.parallel.collectives import barrier
from train.parallel.distributed import DistContext
from train.parallel.weight_sync import gather_full_tensors, unique_state
from train.runtime.checkpoint import _replace_dir
from train.utils.disk import explain_disk_full

GB = 1 << 30


def exported_state(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """What `latest/` holds of a model: its weights, with any LoRA adapters merged into them."""
    return merged_state(model) if has_lora(model) else unique_state(model)


def write_weights(named: Iterable[tuple[str, torch.Tensor]], folder: str, ctx: DistContext, shard_bytes: int,
                  bucket_bytes: int,
                  to_files: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]] | None = None) -> list[str]:
    """Stream (name, tensor) pairs (local shards of one model) into `folder` as safetensors shards
    (rank 0 writes; every rank gathers). `to_files` maps a full tensor to the files' (name, tensor) pairs
    (a renaming; train/models/checkpoint_names.py's hub_layout: a mixture of experts' per-expert tensors).
    Returns the file names."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    index: dict[str, str] = {}

    def flush() -> None:
        nonlocal current, size
        if current:
            name = f"part-{len(shards):05d}.safetensors"
            save_file(current, os.path.join(folder, name), metadata={"format": "pt"})
            shards.append(list(current))
            for key in current:
                index[key] = name
            current, size = {}, 0

    for gathered, full in gather_full_tensors(named, bucket_bytes):
        if not ctx.is_main:
            continue  # the gather is collective; only rank 0 keeps what it brings
        for key, tensor in (to_files(gathered, full) if to_files is not None else [(gathered, full)]):
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > shard_bytes:
                flush()
            current[key] = tensor.detach().to("cpu", copy=True).contiguous()
            size += nbytes
    if not ctx.is_main:
        return []
    flush()
    if len(shards) == 1:  # one file: the plain name, no index
        os.rename(os.path.join(folder, "part-00000.safetensors"), os.path.join(folder, "model.safetensors"))
        return ["model.safetensors"]
    names = {f"part-{i:05d}.safetensors": f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
             for i in range(len(shards))}
    for old, new in names.items():
        os.rename(os.path.join(folder, old), os.path.join(folder, new))
    total = sum(os.path.getsize(os.path.join(folder, n)) for n in names.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in index.items()}}, f,
                  indent=1)
    return list(names.values())


def export_hf(model: torch.nn.Module, tokenizer, out_dir: str, ctx: DistContext, *, shard_bytes: int = 2 * GB,
              bucket_bytes: int = 512 << 20, critic: torch.nn.Module | None = None,
              base_model: str | None = None, image_processor: Any = None) -> None:
    """`out_dir` as a Hugging Face folder that `from_pretrained` loads (model, config, generation
    config, tokenizer), plus `critic/` when given, and `adapter/` for a LoRA model (`base_model`: the
    name its adapter_config.json gives the base); atomic. A vision-language model's `image_processor` is
    saved beside them (preprocessor_config.json), so the folder loads with its processor."""
    with explain_disk_full("the Hugging Face export", out_dir + ".tmp",
                           "the previous export and the checkpoints are untouched"):
        _export(model, tokenizer, out_dir, ctx, shard_bytes, bucket_bytes, critic, base_model, image_processor)


def write_adapter(model: torch.nn.Module, tokenizer, folder: str, ctx: DistContext, bucket_bytes: int,
                  base_model: str | None) -> None:
    """A LoRA model's adapters as a peft folder: adapter_model.safetensors (peft's names) and
    adapter_config.json naming `base_model` (rank 0 writes; every rank gathers)."""
    from safetensors.torch import save_file

    tensors = {peft_key(k): t.detach().to("cpu", copy=True).contiguous()
               for k, t in gather_full_tensors(adapter_state(model), bucket_bytes)}
    if not ctx.is_main:
        return
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.peft_config[ADAPTER_NAME])  # what inject_adapter_in_model recorded
    config.base_model_name_or_path, config.task_type = base_model, "CAUSAL_LM"
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _export(model: torch.nn.Module, tokenizer, out_dir: str, ctx: DistContext, shard_bytes: int, bucket_bytes: int,
            critic: torch.nn.Module | None, base_model: str | None, image_processor: Any = None) -> None:
    tmp = out_dir + ".tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    write_weights(exported_state(model), tmp, ctx, shard_bytes, bucket_bytes, to_files=hub_layout(model))
    if has_lora(model):
        write_adapter(model, tokenizer, os.path.join(tmp, "adapter"), ctx, bucket_bytes, base_model)
    if critic is not None:
        if ctx.is_main:
            os.makedirs(os.path.join(tmp, "critic"))
        write_weights(exported_state(critic), os.path.join(tmp, "critic"), ctx, shard_bytes, bucket_bytes,
                      to_files=lambda k, t: [(k.replace("value_head.", "score."), t)])
    if ctx.is_main:
        model.config.save_pretrained(tmp)  # its `architectures` name the causal LM class (FSDP renames the type)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if image_processor is not None:
            image_processor.save_pretrained(tmp)
        if critic is not None:
            cfg = copy.deepcopy(critic.config)
            base = (cfg.architectures or ["LlamaForCausalLM"])[0].removesuffix("ForCausalLM")
            cfg.architectures = [f"{base}ForTokenClassification"]
            cfg.num_labels = 1
            cfg.save_pretrained(os.path.join(tmp, "critic"))
            tokenizer.save_pretrained(os.path.join(tmp, "critic"))
        _replace_dir(tmp, out_dir)
    barrier()
