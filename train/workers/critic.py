"""The critic for PPO (`adv.estimator=gae`): a value head on a copy of the actor's architecture,
with its own optimizer and scheduler, trained on the clipped value loss.

The same layout rule as the actor: samples are spread over dp groups and packed; each micro-batch's
loss is a sum over its action tokens divided by the global action-token count of the mini-batch
(all micro-batches, all dp groups, counted once), times ddp * fsdp to undo FSDP's averaging.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from train.utils import algorithms as alg
from train.utils.dispatch import Dispatch
from train.utils.distributed import DistContext, all_reduce_sum
from train.utils.packing import PackedMicroBatch
from train.utils.parallel import Layout, layout_for
from train.utils.seq_parallel import gather_sequence
from train.workers import base


@dataclass
class CriticBatch:
    """This rank's share of a mini-batch; per-token tensors have length len(ids) - 1."""
    ids: list[list[int]]
    action_mask: list[list[int]]
    returns: list[torch.Tensor]
    old_values: list[torch.Tensor]  # values before this update (for the value clip)


class Critic:
    def __init__(self, cfg, ctx: DistContext, model_path: str, *, pad_token_id: int, total_updates: int = 1,
                 gradient_checkpointing: bool = False, dtype: str = "float32", layout: Layout | None = None):
        self.cfg, self.ctx, self.pad_id = cfg, ctx, pad_token_id
        self.layout = layout or layout_for(cfg, ctx.world_size, ctx.device.type, "critic")
        self.model = base.load_value_model(model_path, device=ctx.device)
        base.parallelize(self.model, self.layout, param_dtype=dtype if ctx.device.type == "cuda" else "float32",
                         gradient_checkpointing=gradient_checkpointing, offload=bool(cfg.get("offload_model")))
        self.offload_optimizer = bool(cfg.get("offload_optimizer"))
        self.optimizer = base.build_optimizer(self.model, cfg.lr, cfg.betas, cfg.weight_decay)
        self.scheduler = base.build_scheduler(self.optimizer, total_updates, cfg.warmup_ratio, "constant", 1.0)
        self.infer_tokens = cfg.get("max_inference_length_per_device") or 2 * cfg.max_length_per_device

    def _micro_batches(self, index: list[int], ids, masks, max_tokens: int) -> list[PackedMicroBatch]:
        return base.packed_micro_batches(index, ids, masks, max_tokens, self.pad_id, self.layout, self.ctx.device)

    def _forward(self, mb: PackedMicroBatch) -> torch.Tensor:
        """[samples, longest - 1]: entry t holds V(state after token t), the value before action
        token t+1 (aligned with labels)."""
        sp_group = self.layout.sp_group  # of size 1 without sequence parallelism: nothing to gather
        values = self.model(**mb.model_inputs(), sp_group=sp_group)[0].float()
        return mb.rows(gather_sequence(values, sp_group))

    @torch.no_grad()
    def compute_values(self, ids: list[list[int]], masks: list[list[int]]) -> list[torch.Tensor]:
        """V for every position of every (own) sequence, as [len-1] CPU tensors (see _forward)."""
        self.model.eval()
        return base.per_sample_pass(
            ids, masks, self.layout, self.ctx.device,
            lambda index, g_ids, g_masks: self._micro_batches(index, g_ids, g_masks, self.infer_tokens),
            self._forward)

    def update(self, batch: CriticBatch) -> dict[str, float]:
        """`critic.update_per_rollout` passes, `critic.mini_batches` optimizer steps per pass."""
        cfg = self.cfg
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
        self.model.train()
        for _ in range(cfg.update_per_rollout):
            for part in range(cfg.mini_batches):
                index = list(range(len(batch.ids)))[part::cfg.mini_batches]
                self.accumulate_gradients(batch, index, sums)
                grad_norms.append(self._optimizer_step())
        keys = sorted(sums)
        totals = dict(zip(keys, all_reduce_sum([sums[k] for k in keys], self.ctx.device)))
        tokens = max(totals.pop("tokens"), 1.0)
        metrics = {"critic/value_loss": totals.pop("loss") / len(grad_norms)}
        metrics.update({f"critic/{k}": v / tokens for k, v in totals.items()})
        metrics["critic/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["critic/grad_norm_max"] = max(grad_norms)
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def accumulate_gradients(self, batch: CriticBatch, index: list[int], sums: dict[str, float]) -> None:
        """Backward of the clipped value loss over this rank's samples `index` of one mini-batch
        (spread over dp groups first; metric sums from one rank per dp group)."""
        cfg = self.cfg
        dispatch = Dispatch([len(batch.ids[i]) for i in index], self.layout, self.ctx.device)
        got = dispatch.scatter({"ids": [torch.tensor(batch.ids[i]) for i in index],
                                "mask": [torch.tensor(batch.action_mask[i]) for i in index],
                                "returns": [batch.returns[i] for i in index],
                                "old": [batch.old_values[i] for i in index]})
        ids, masks = base.token_lists(got["ids"]), base.token_lists(got["mask"])
        returns_all, old_all = [t.float() for t in got["returns"]], [t.float() for t in got["old"]]
        leader = self.layout.is_data_leader
        n_tok = all_reduce_sum([float(sum(sum(m[1:]) for m in masks)) if leader else 0.0], self.ctx.device)[0]
        local: dict[str, float] = {}
        for mb in self._micro_batches(list(range(len(ids))), ids, masks, cfg.max_length_per_device):
            values = self._forward(mb)
            mask = mb.action_mask
            returns = mb.pad_token_tensor(returns_all).to(values.device)
            old = mb.pad_token_tensor(old_all).to(values.device)
            token_loss, stats = alg.value_loss(values, old, returns, mask, cfg.clip)
            loss = alg.aggregate_loss(token_loss, mask, "all_token_mean", n_tokens_global=max(n_tok, 1.0),
                                      n_seqs_global=1.0)
            (loss * self.layout.grad_scale).backward()  # undo FSDP's averaging: the normaliser is global
            n_mask = float(mask.sum())
            local["loss"] = local.get("loss", 0.0) + float(loss.detach())
            local["clip_fraction"] = local.get("clip_fraction", 0.0) + float(stats["clip_fraction"]) * n_mask
            local["values"] = local.get("values", 0.0) + float(stats["values"]) * n_mask
            local["tokens"] = local.get("tokens", 0.0) + n_mask
        for key, value in local.items():
            sums[key] = sums.get(key, 0.0) + (value if leader else 0.0)

    def _optimizer_step(self) -> float:
        return base.clip_and_step(self.model, self.optimizer, self.scheduler, self.cfg.max_grad_norm,
                                  offload_optimizer=self.offload_optimizer)
