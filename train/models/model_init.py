"""Building a model for its layout without ever holding the whole model on a rank.

Every rank builds the architecture on the `meta` device (no memory), applies the parallel plan
(train/parallel/parallelize.py: TP, packed attention, activation checkpointing, FSDP2), allocates
only its local shards (`to_empty`), and fills them from the checkpoint: for each tensor it reads
just the slice it holds from the safetensors files (memory-mapped), so memory per rank falls with
the number of ranks from start-up on. FSDP over rows already split by TP or EP (a `_StridedShard`) still
holds one block: FSDP splits the TP/EP piece again. A placement whose piece is not one block would
read that one tensor whole and keep its piece. Non-persistent buffers
(rotary frequencies) are recomputed the way the model's own constructor computes them, tied
embeddings stay tied, and the critic's value head starts at zero: the result is what
`from_pretrained` gives, bit for bit
(tests/integration/test_checkpoints.py::test_meta_loading_equals_from_pretrained).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoModel

from train.models.checkpoint_names import ConvertedReader, conversions_of, pretrained_model
from train.models.lora import FreshAdapters, LoraSettings, apply_lora, base_name, is_adapter
from train.models.vlm import is_vision_config, model_class
from train.parallel.layout import Layout
from train.parallel.parallelize import DTYPES, parallelize


class ModelWeightsError(ValueError):
    """A model folder whose weights cannot fill the model; says which file or tensor."""


class WeightReader:
    """The tensors of a Hugging Face model folder: `model.safetensors`, sharded safetensors with
    `model.safetensors.index.json`, or (older repositories) `pytorch_model*.bin`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._files: dict[str, str] = {}  # tensor name -> file
        self._open: dict[str, object] = {}
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self._files = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.exists(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self._files = {k: single for k in f.keys()}
        else:
            bins = sorted(f for f in os.listdir(folder) if f.startswith("pytorch_model") and f.endswith(".bin"))
            if not bins:
                raise ModelWeightsError(f"{folder}: no model.safetensors, safetensors index or pytorch_model*.bin")
            for name in bins:  # memory-mapped: only what is read is paged in
                state = torch.load(os.path.join(folder, name), map_location="cpu", mmap=True, weights_only=True)
                self._open[os.path.join(folder, name)] = state
                self._files.update({k: os.path.join(folder, name) for k in state})

    def keys(self) -> list[str]:
        return list(self._files)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `name`, or just its block `index` (one slice per dim), read from disk."""
        path = self._files[name]
        if path.endswith(".bin"):
            t = self._open[path][name]
            return (t[index] if index is not None else t).clone()
        handle = self._open.get(path)
        if handle is None:
            from safetensors import safe_open

            handle = self._open[path] = safe_open(path, framework="pt")
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]


def _local_block(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The block of the full tensor this rank holds, or None when its piece is not one block."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if any(not isinstance(p, (Shard, _StridedShard)) and not p.is_replicate() and not p.is_partial()
           for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def fill_from_checkpoint(model: torch.nn.Module, reader: WeightReader, rename: Callable[[str], str] = lambda k: k,
                         skip: Callable[[str], bool] = lambda k: False) -> None:
    """Copy every state-dict entry's local piece from the checkpoint (checkpoint name `rename(key)`);
    entries for which `skip(key)` holds are left alone. A missing tensor or a shape mismatch is a
    ModelWeightsError naming it."""
    from torch.distributed.tensor import distribute_tensor

    available = set(reader.keys())
    done: set[int] = set()
    for key, value in model.state_dict().items():
        if skip(key):
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.numel() and local.untyped_storage().data_ptr() in done:
            continue  # tied to a tensor already filled
        name = rename(key)
        if name not in available:
            raise ModelWeightsError(f"{reader.folder}: no tensor '{name}' for the model's '{key}' "
                                    f"(the checkpoint holds {len(available)} tensors, e.g. {sorted(available)[:3]})")
        if hasattr(value, "device_mesh"):
            block = _local_block(value)
            if block is not None:
                piece = reader.read(name, block)
            else:  # one tensor whole, then this rank's piece of it (no communication)
                full = reader.read(name)
                piece = distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None).to_local()
        else:
            piece = reader.read(name)
        if tuple(piece.shape) != tuple(local.shape):
            raise ModelWeightsError(f"{reader.folder}: tensor '{name}' has shape {tuple(piece.shape)} where the "
                                    f"model's '{key}' holds {tuple(local.shape)} on this rank (full "
                                    f"{tuple(value.shape)}): a different model shape")
        local.copy_(piece)
        if local.numel():
            done.add(local.untyped_storage().data_ptr())


@torch.no_grad()
def reset_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Buffers that are not in the checkpoint (rotary inverse frequencies, Gemma's embedding scale)
    hold garbage after `to_empty`: recompute them as the model's constructor did, by building a
    module that has a config again from it, else through the model's own `_init_weights` for that
    module with its parameters marked as initialised (transformers then sets only the buffers)."""
    pretrained = pretrained_model(model)
    for name, module in model.named_modules():
        missing = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if not missing:
            continue
        config = getattr(module, "config", None)
        if config is not None:
            fresh = type(module)(config)
            for b in missing:
                getattr(module, b).copy_(getattr(fresh, b))
            continue
        for b in missing:  # NaN until set: what _init_weights leaves alone is caught below
            if getattr(module, b).is_floating_point():
                getattr(module, b).fill_(float("nan"))
        params = list(module.parameters(recurse=False))
        for p in params:
            p._is_hf_initialized = True
        try:
            if pretrained is not None:
                pretrained._init_weights(module)
        finally:
            for p in params:
                del p._is_hf_initialized
        unset = [b for b in missing if getattr(module, b).is_floating_point() and getattr(module, b).isnan().any()]
        if pretrained is None or unset:
            raise ModelWeightsError(f"cannot rebuild the non-persistent buffers {unset or missing} of '{name}' "
                                    f"({type(module).__name__}): it has no config and the model's _init_weights "
                                    "does not set them")


def build_model(path: str, layout: Layout, device: torch.device, *, value_head: bool = False,
                param_dtype: str = "float32", gradient_checkpointing: bool = False,
                offload: bool = False, lora: LoraSettings | None = None, lora_key: str = "actor.lora",
                adapter_seed: int = 0, compile_layers: bool = False, frozen: bool = False,
                master_weights: bool = False) -> torch.nn.Module:
    """The causal LM of `path` (or with `value_head`, its backbone with a zero value head: the
    critic), wrapped for `layout`, with only this rank's shards ever allocated. With `lora` enabled,
    LoRA adapters are injected before the parallel plan (train/models/lora.py): the base is frozen
    and filled from `path`, the adapters start as B = 0 (the base model's outputs) and A drawn from
    `adapter_seed`; the critic's value head stays trainable. `compile_layers`: torch.compile each decoder
    layer (parallelize.apply_compile). `frozen` (a model that never trains: a KL reference, a teacher): every
    weight held in `param_dtype` (bf16: 2 bytes a parameter, cast once, not at every forward), one process's
    text model a plain module. `master_weights`: one process's model left plain and in fp32 for the caller's
    MasterWeights (train/models/master_weights.py) to turn into bf16 weights with fp32 masters."""
    from train.models.value_model import ValueModel

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        if value_head:
            model = ValueModel(AutoModel.from_config(config, dtype=torch.float32))
        else:
            model = model_class(config).from_config(config, dtype=torch.float32)
    with_lora = lora is not None and lora.enabled
    if with_lora:
        apply_lora(model.model if value_head else model, lora, key=f"{lora_key}.target_modules")
        if param_dtype != "float32":
            # A frozen base needs no fp32 master copy: keep it in the compute dtype (half the bytes);
            # the trainable adapters (and the critic's head) stay fp32. FSDP2 only asks the trainable
            # parameters of a group for one dtype.
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(DTYPES[param_dtype])
    if frozen and param_dtype != "float32":  # no fp32 copy of weights that never change (as a LoRA base above)
        for p in model.parameters():
            p.data = p.data.to(DTYPES[param_dtype])
    tied = bool(getattr(config, "tie_word_embeddings", False)) and not value_head
    conversions = conversions_of(model)  # before FSDP renames the classes they are found by
    # FSDP2 also casts each wrapped block's float inputs (a vision tower's rotary tables): a plain bf16
    # vision-language model would compute those in fp32, so it keeps FSDP
    plain = master_weights or (frozen and not is_vision_config(config))
    parallelize(model, layout, param_dtype=param_dtype, gradient_checkpointing=gradient_checkpointing,
                offload=offload, compile_layers=compile_layers, plain=plain)
    model.to_empty(device=device)
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        model.tie_weights()  # to_empty gives each module its own tensor: tie them again
    reset_non_persistent_buffers(model)
    # the Hub's key layout under the model's names (MoE experts, a VLM's language_model/visual prefixes)
    reader = ConvertedReader(WeightReader(path), model, conversions)
    if value_head:
        names = set(reader.keys())
        head = "score" if "score.weight" in names else None  # a critic exported by this trainer

        def rename(key: str) -> str:
            key = base_name(key)
            if key.startswith("value_head."):
                return key.replace("value_head.", f"{head}.")
            return key if key in names else key[len("model."):]  # a bare backbone folder

        fill_from_checkpoint(model, reader, rename,
                             skip=lambda k: is_adapter(k) or (k.startswith("value_head.") and head is None))
        if head is None:  # a fresh head: V = 0 at the start, the same on every rank and run
            with torch.no_grad():
                for p in model.value_head.parameters():
                    (p.to_local() if hasattr(p, "to_local") else p).zero_()
    else:
        fill_from_checkpoint(model, reader, base_name, skip=lambda k: is_adapter(k) or (tied and k == "lm_head.weight"))
    if with_lora:
        fill_from_checkpoint(model, FreshAdapters(model, adapter_seed), skip=lambda k: not is_adapter(k))
    if getattr(model, "generation_config", None) is not None and not value_head:
        try:  # what from_pretrained would attach (EOS ids for the export)
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass
    return model
