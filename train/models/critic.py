"""The critic for PPO (`adv.estimator=gae`): a value head on a copy of the actor's architecture,
with its own optimizer and scheduler, trained on the clipped value loss over the step batch.

The same layout rule as the actor (train/models/trainable.py): each micro-batch's loss is a sum
over its action tokens divided by the global action-token count of the mini-batch (all
micro-batches, all dp groups, counted once), times ddp * fsdp to undo FSDP's averaging.
"""
from __future__ import annotations

import torch
from transformers import AutoConfig

from train.algorithms.aggregation import aggregate_loss
from train.algorithms.value_loss import value_loss as clipped_value_loss
from train.models import optim
from train.models.config import CriticConfig, compute_dtype, replaced
from train.models.lora import LoraSettings
from train.models.master_weights import decide_master_weights, master_weights_refusal
from train.models.model_init import build_model
from train.models.trainable import Norms, Trainable, UpdateStats
from train.models.vlm import is_vision_config
from train.parallel.distributed import DistContext
from train.parallel.layout import Layout, layout_for
from train.parallel.packing import PackedMicroBatch
from train.parallel.parallelize import DTYPES
from train.parallel.step_batch import StepBatch


class Critic(Trainable):
    lm_head = False  # a value head: no vocabulary head's backward to plan for

    def __init__(self, cfg: CriticConfig, ctx: DistContext, model_path: str, *, pad_token_id: int, total_updates: int = 1,
                 layout: Layout | None = None, adapter_seed: int = 0):
        layout = layout or layout_for(cfg, ctx.world_size, ctx.device.type, "critic")
        cfg = replaced(cfg, dtype=compute_dtype(cfg.dtype, ctx.device.type))  # null: bf16 on a GPU
        super().__init__(layout, ctx.device, pad_token_id, cfg.max_length_per_device,
                         cfg.max_inference_length_per_device or 2 * cfg.max_length_per_device,
                         cfg.max_grad_norm, bool(cfg.offload_optimizer),
                         bool(cfg.offload_model))
        self.cfg, self.ctx = cfg, ctx
        # The backbone of `model_path` (or a critic this trainer exported) and a value head, built on
        # the meta device and filled shard by shard; critic.lora: adapters on the backbone, the value
        # head fully trained.
        self.lora = LoraSettings.from_config(cfg.lora)
        # critic.master_weights=null: on where it applies on a CPU; off on a GPU, which the actor's memory plan
        # does not cover for the critic
        vision = cfg.dtype == "bfloat16" and is_vision_config(AutoConfig.from_pretrained(model_path))
        why = master_weights_refusal("critic", self.layout.fsdp_mesh.size() * self.layout.sizes.tp, cfg.dtype,
                                     bool(cfg.offload_model), vision)
        masters = decide_master_weights(cfg.master_weights, "critic", why, ctx.device.type == "cpu")
        self.model = build_model(model_path, self.layout, ctx.device, value_head=True,
                                 param_dtype=cfg.dtype,
                                 gradient_checkpointing=cfg.gradient_checkpointing, offload=bool(cfg.offload_model),
                                 lora=self.lora, lora_key="critic.lora", adapter_seed=adapter_seed,
                                 compile_layers=bool(cfg.compile), master_weights=masters)
        if masters:  # bf16 weights, fp32 masters cast into them once per optimizer step
            self.use_master_weights(DTYPES[cfg.dtype])
        self.optimizer = optim.build_optimizer(self.trained, cfg.lr, cfg.betas, cfg.weight_decay)
        self.scheduler = optim.build_scheduler(self.optimizer, total_updates, cfg.warmup_ratio, "constant", 1.0)

    def _forward(self, mb: PackedMicroBatch) -> torch.Tensor:
        """[samples, longest - 1]: entry t holds V(state after token t), the value before action
        token t+1 (aligned with labels)."""
        values = self.model(**mb.model_inputs(), **self.layout.attention_groups())[0].float()
        return mb.rows(mb.whole_row(values, self.layout.sp_group))  # (a group of 1 without a split: no gather)

    def compute_values(self, batch: StepBatch) -> list[torch.Tensor]:
        """V for every position of every sample of the batch, as [len-1] CPU tensors (see _forward)."""
        return self.per_token_pass(batch, self._forward)

    def value_loss(self, batch: StepBatch):
        """The loss hook: the clipped value loss of one packed micro-batch, and its metric sums."""
        clip = self.cfg.clip

        def loss(mb: PackedMicroBatch, norms: Norms, stats: UpdateStats) -> torch.Tensor:
            values = self._forward(mb)
            mask = mb.action_mask
            returns = mb.gather(batch.fields["returns"], "returns")
            old = mb.gather(batch.fields["values"], "values")
            token_loss, st = clipped_value_loss(values, old, returns, mask, clip)
            value = aggregate_loss(token_loss, mask, "all_token_mean", n_tokens_global=norms.tokens,
                                   n_seqs_global=1.0)
            n_mask = mask.sum()
            stats.add("loss", value.detach())
            stats.add("clip_fraction", st["clip_fraction"] * n_mask)
            stats.add("values", st["values"] * n_mask)
            stats.add("tokens", n_mask)
            return value

        return loss

    def update(self, batch: StepBatch) -> dict[str, float]:
        """`critic.update_per_rollout` passes, `critic.mini_batches` optimizer steps per pass."""
        stats = self.run_update(batch, self.cfg.update_per_rollout, self.cfg.mini_batches, self.value_loss(batch))
        metrics = self.reduce(stats, "critic", ("loss", "clip_fraction", "values", "tokens"))
        metrics["critic/value_loss"] = metrics.pop("critic/loss")
        return metrics
