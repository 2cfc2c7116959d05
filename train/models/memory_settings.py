"""The actor's null memory settings, decided once when it is built (train/models/memory_plan.py has the rules).

Three decisions, in this order, each on the values the one before chose:
1. `with_memory_settings`: actor.max_length_per_device, gradient_checkpointing and use_liger_kernel.
2. `with_master_weights`: actor.master_weights.
3. `recompute_threshold`: where a null gradient_checkpointing came out on, the longest micro-batch that skips the
   recompute.

They read the same three facts, and `BuildRoom` reads each at most once and only where a decision needs it:
the model's config (a small JSON file), the least free device memory of any rank (one scalar all-reduce, so
every rank decides alike), and what the run's other models will keep (a count of their parameters on the meta
device). Whether a fact is needed depends only on the config section, the layout and the device type, so every
rank makes the same collective call or none.

Where the rollout engine stays awake through the update (rollout.sleep=false, rollout.max_staleness >= 1: it
generates meanwhile), the actor plans with half of what is left after the engine's own weights, since the
engine's static KV buffers take up to half of the memory free when it decodes (train/engines/hf.py).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch

from train.models.config import ActorConfig, entropy_in_loss, replaced
from train.models.master_weights import decide_master_weights, master_weights_refusal
from train.models.memory_plan import (CPU_MAX_LENGTH, AutoSettings, auto_settings, master_weights_fit,
                                      recompute_above)
from train.models.vlm import is_vision_config
from train.parallel.collectives import all_reduce_max
from train.parallel.distributed import DistContext
from train.parallel.layout import Layout


class BuildRoom:
    """What an actor's build decides its memory settings from, each read at most once, when first asked:
    `config` (the model's transformers config), `least_free` (the least free device memory of any rank:
    collective) and `reserved` (`reserved_bytes`, or what the function given says: what the run's other models
    will keep)."""

    def __init__(self, ctx: DistContext, model_path: str, reserved_bytes: int | Callable[[], int] = 0,
                 awake_engine_bytes: int | Callable[[], int] | None = None) -> None:
        self.ctx, self.model_path, self.reserved_bytes = ctx, model_path, reserved_bytes
        self.awake_engine_bytes = awake_engine_bytes  # the engine's own weights where it stays awake (else None)

    @property
    def on_gpu(self) -> bool:
        return self.ctx.device.type == "cuda"

    @cached_property
    def config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_path)

    @cached_property
    def least_free(self) -> int:
        return int(-all_reduce_max(-float(torch.cuda.mem_get_info(self.ctx.device)[0]), self.ctx.device))

    @cached_property
    def reserved(self) -> int:
        return self.reserved_bytes() if callable(self.reserved_bytes) else self.reserved_bytes

    @cached_property
    def engine(self) -> int | None:
        """The rollout engine's own weights where it stays awake through the update; None where it sleeps when
        the update needs its memory."""
        awake = self.awake_engine_bytes
        return awake() if callable(awake) else awake

    @property
    def free(self) -> int:
        """The least free memory of any rank less what the other models will keep; beside an awake engine, half
        of what its weights leave (its KV buffers take up to the other half)."""
        left = self.least_free - self.reserved
        return left if self.engine is None else (left - self.engine) // 2


def with_memory_settings(cfg: ActorConfig, room: BuildRoom, layout: Layout, train: bool
                         ) -> tuple[ActorConfig, str | None]:
    """`cfg` with actor.max_length_per_device, gradient_checkpointing and use_liger_kernel decided where they
    are null (memory_plan.auto_settings: from the model's shapes and the free memory on a GPU; 4096, off, off on
    CPU), and the line that says how (None when none was null)."""
    settings = (cfg.max_length_per_device, cfg.gradient_checkpointing, cfg.use_liger_kernel)
    if None not in settings:
        return cfg, None
    # auto_settings takes the reserve (the other models, and beside an awake engine its share) off the free memory
    config, free, reserved = ((room.config, room.least_free, room.least_free - room.free) if room.on_gpu
                              else (None, None, 0))
    try:
        auto = auto_settings(*settings, config=config, device_type=room.ctx.device.type, free_bytes=free,
                             lora_rank=cfg.lora.rank if train else 0, shards=layout.sizes.fsdp, tp_size=layout.sizes.tp,
                             offload_optimizer=bool(cfg.offload_optimizer), offload_model=bool(cfg.offload_model),
                             reserved_bytes=reserved, entropy=train and entropy_in_loss(cfg.entropy))
    except Exception as e:  # a model the plan cannot read: the CPU defaults, with checkpointing, and why
        length = settings[0] or CPU_MAX_LENGTH
        ckpt = True if settings[1] is None else settings[1]
        head = bool(settings[2])
        auto = AutoSettings(length, ckpt, head,
                            f"no memory estimate for {room.model_path} ({type(e).__name__}: {str(e)[:120]}): "
                            f"max_length_per_device {length}, gradient_checkpointing {'on' if ckpt else 'off'}, "
                            f"fused head {'on' if head else 'off'}")
    return replaced(cfg, max_length_per_device=auto.max_length_per_device,
                     gradient_checkpointing=auto.gradient_checkpointing, use_liger_kernel=auto.use_liger_kernel), auto.note


def with_master_weights(cfg: ActorConfig, room: BuildRoom, layout: Layout, train: bool) -> ActorConfig:
    """`cfg` with actor.master_weights decided (train/models/master_weights.py): where it applies (one process
    holds the whole text model in bf16 on the device), null is on on a CPU, and on a GPU when the update's plan
    with the bf16 copies (2 more bytes per trainable parameter for the weights and 2 for the backward's
    gradients, no FSDP unshard) fits the least free memory of any rank at the settings chosen, less what the
    other models keep. A reference (train=False) holds no masters."""
    if not train or (cfg.dtype != "bfloat16" and not cfg.master_weights):
        return replaced(cfg, master_weights=False)
    why = master_weights_refusal("actor", layout.fsdp_mesh.size() * layout.sizes.tp, cfg.dtype, bool(cfg.offload_model),
                                 is_vision_config(room.config))
    default = True
    if why is None and cfg.master_weights is None and room.on_gpu:
        default = master_weights_fit(room.config, seq=cfg.max_length_per_device, lora_rank=cfg.lora.rank,
                                     fused_head=bool(cfg.use_liger_kernel), checkpointing=bool(cfg.gradient_checkpointing),
                                     free_bytes=room.free, offload_optimizer=bool(cfg.offload_optimizer),
                                     entropy=entropy_in_loss(cfg.entropy))
    return replaced(cfg, master_weights=decide_master_weights(cfg.master_weights, "actor", why, default))


def recompute_threshold(cfg: ActorConfig, asked: bool | None, room: BuildRoom, layout: Layout,
                        train: bool) -> int | None:
    """Where a null actor.gradient_checkpointing (`asked`) came out on for a GPU's update: the longest micro-batch
    that fits without it (memory_plan.recompute_above, with the master weights decided), so shorter ones skip
    the recompute; None (every micro-batch recomputes) where checkpointing was set, is off, on a CPU, for a
    vision-language model (the plan leaves out its tower's activations) or under expert parallelism (the tokens a
    rank's experts receive are not its own)."""
    if not (train and asked is None and cfg.gradient_checkpointing and room.on_gpu and layout.sizes.ep == 1):
        return None
    free = room.free
    try:
        config = room.config
        if is_vision_config(config):
            return None
        return recompute_above(config, length=cfg.max_length_per_device, fused_head=bool(cfg.use_liger_kernel),
                               free_bytes=free, lora_rank=cfg.lora.rank, shards=layout.sizes.fsdp,
                               offload_optimizer=bool(cfg.offload_optimizer), offload_model=bool(cfg.offload_model),
                               master_weights=bool(cfg.master_weights), entropy=entropy_in_loss(cfg.entropy))
    except Exception:  # a model the plan cannot read: every micro-batch recomputes, as with_memory_settings chose
        return None


def decided_memory_settings(cfg: ActorConfig, room: BuildRoom, layout: Layout, train: bool
                            ) -> tuple[ActorConfig, str | None, int | None]:
    """The three decisions in order: `cfg` with every null memory setting decided, the line that says how (None
    when none was null), and the recompute threshold (None: every micro-batch recomputes, or none does)."""
    checkpointing_asked = cfg.gradient_checkpointing
    cfg, note = with_memory_settings(cfg, room, layout, train)
    cfg = with_master_weights(cfg, room, layout, train)
    threshold = recompute_threshold(cfg, checkpointing_asked, room, layout, train)
    if threshold is not None:
        note = f"{note}; micro-batches of up to {threshold} tokens keep their activations (no recompute)"
    if note is not None and room.on_gpu and room.engine is not None:
        note += (f"; planned with half the memory the rollout engine leaves (awake through the update: "
                 f"rollout.sleep=false or rollout.max_staleness >= 1; its own weights {room.engine / 2**30:.1f} GiB, "
                 "its KV buffers up to the other half)")
    return cfg, note, threshold
