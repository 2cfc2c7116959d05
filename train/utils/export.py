"""The Hugging Face export (`latest/`), streamed: full tensors are gathered a bucket at a time
(train/parallel/weight_sync.py) and rank 0 writes them into safetensors shards of at most
`shard_bytes`, with `model.safetensors.index.json` when there are several. No process ever holds
more than one shard and one bucket of the model. The folder is written as `<out>.tmp` and renamed.

The critic (PPO) goes to `critic/` as a token-classification model with one label: its backbone,
and the value head as `score` (`AutoModelForTokenClassification.from_pretrained(latest/critic)`
gives the values as `logits[..., 0]`; the critic can resume from that folder too).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable

import torch

from train.parallel.collectives import barrier
from train.parallel.distributed import DistContext
from train.parallel.weight_sync import gather_full_tensors, unique_state
from train.utils.checkpoint import _replace_dir
from train.utils.disk import explain_disk_full

GB = 1 << 30


def write_weights(model: torch.nn.Module, folder: str, ctx: DistContext, shard_bytes: int, bucket_bytes: int,
                  rename: Callable[[str], str] = lambda k: k) -> list[str]:
    """Stream the model's weights into `folder` (rank 0 writes; every rank gathers). Returns the file names."""
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

    for key, tensor in gather_full_tensors(unique_state(model), bucket_bytes):
        if not ctx.is_main:
            continue  # the gather is collective; only rank 0 keeps what it brings
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            flush()
        current[rename(key)] = tensor.detach().to("cpu", copy=True).contiguous()
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
              bucket_bytes: int = 512 << 20, critic: torch.nn.Module | None = None) -> None:
    """`out_dir` as a Hugging Face folder that `from_pretrained` loads (model, config, generation
    config, tokenizer), plus `critic/` when given; atomic."""
    with explain_disk_full("the Hugging Face export", out_dir + ".tmp",
                           "the previous export and the checkpoints are untouched"):
        _export(model, tokenizer, out_dir, ctx, shard_bytes, bucket_bytes, critic)


def _export(model: torch.nn.Module, tokenizer, out_dir: str, ctx: DistContext, shard_bytes: int, bucket_bytes: int,
            critic: torch.nn.Module | None) -> None:
    tmp = out_dir + ".tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    write_weights(model, tmp, ctx, shard_bytes, bucket_bytes)
    if critic is not None:
        if ctx.is_main:
            os.makedirs(os.path.join(tmp, "critic"))
        write_weights(critic, os.path.join(tmp, "critic"), ctx, shard_bytes, bucket_bytes,
                      rename=lambda k: k.replace("value_head.", "score."))
    if ctx.is_main:
        model.config.save_pretrained(tmp)  # its `architectures` name the causal LM class (FSDP renames the type)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if critic is not None:
            cfg = copy.deepcopy(critic.config)
            base = (cfg.architectures or ["LlamaForCausalLM"])[0].removesuffix("ForCausalLM")
            cfg.architectures = [f"{base}ForTokenClassification"]
            cfg.num_labels = 1
            cfg.save_pretrained(os.path.join(tmp, "critic"))
            tokenizer.save_pretrained(os.path.join(tmp, "critic"))
        _replace_dir(tmp, out_dir)
    barrier()
