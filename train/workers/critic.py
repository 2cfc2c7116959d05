"""The critic for PPO (`adv.estimator=gae`): a value head on a copy of the actor's architecture,
with its own optimizer and scheduler, trained on the clipped value loss.

The same layout rule as the actor: each micro-batch's loss is a sum over its action tokens divided
by the global action-token count of the mini-batch (all micro-batches, all data-parallel ranks),
times the data-parallel size to undo FSDP's gradient averaging.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from train.utils import algorithms as alg
from train.utils.batching import MicroBatch
from train.utils.distributed import DistContext, all_reduce_sum
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
                 gradient_checkpointing: bool = False, dtype: str = "float32"):
        self.cfg, self.ctx, self.pad_id = cfg, ctx, pad_token_id
        self.model = base.load_value_model(model_path, device=ctx.device)
        if gradient_checkpointing:
            base.apply_ac(self.model)
        base.apply_fsdp(self.model, ctx.mesh, param_dtype=dtype if ctx.device.type == "cuda" else "float32")
        self.optimizer = base.build_optimizer(self.model, cfg.lr, cfg.betas, cfg.weight_decay)
        self.scheduler = base.build_scheduler(self.optimizer, total_updates, cfg.warmup_ratio, "constant", 1.0)
        self.infer_tokens = 2 * cfg.max_length_per_device

    def _micro_batches(self, index: list[int], ids, masks, max_tokens: int) -> list[MicroBatch]:
        return base.padded_micro_batches(index, ids, masks, max_tokens, self.pad_id, self.ctx)

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        # Position t holds V(state after token t), the value before action token t+1: aligned with labels.
        return self.model(mb.input_ids, mb.attention_mask)[:, :-1].float()

    @torch.no_grad()
    def compute_values(self, ids: list[list[int]], masks: list[list[int]]) -> list[torch.Tensor]:
        """V for every position of every sequence, as [len-1] CPU tensors (see _forward)."""
        self.model.eval()
        out: list[torch.Tensor | None] = [None] * len(ids)
        for mb in self._micro_batches(list(range(len(ids))), ids, masks, self.infer_tokens):
            values = self._forward(mb)
            for row, i in enumerate(mb.index):
                out[i] = values[row, : len(ids[i]) - 1].cpu()
        return out

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
        """Backward of the clipped value loss over this rank's samples `index` of one mini-batch."""
        cfg = self.cfg
        n_tok = all_reduce_sum([float(sum(sum(batch.action_mask[i][1:]) for i in index))], self.ctx.device)[0]
        for mb in self._micro_batches(index, batch.ids, batch.action_mask, cfg.max_length_per_device):
            values = self._forward(mb)
            mask = mb.action_mask
            returns = mb.pad_token_tensor(batch.returns).to(values.device)
            old = mb.pad_token_tensor(batch.old_values).to(values.device)
            token_loss, stats = alg.value_loss(values, old, returns, mask, cfg.clip)
            loss = alg.aggregate_loss(token_loss, mask, "all_token_mean", n_tokens_global=max(n_tok, 1.0),
                                      n_seqs_global=1.0)
            (loss * self.ctx.world_size).backward()  # undo FSDP's averaging: the normaliser is global
            n_mask = float(mask.sum())
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            sums["clip_fraction"] = sums.get("clip_fraction", 0.0) + float(stats["clip_fraction"]) * n_mask
            sums["values"] = sums.get("values", 0.0) + float(stats["values"]) * n_mask
            sums["tokens"] = sums.get("tokens", 0.0) + n_mask

    def _optimizer_step(self) -> float:
        return base.clip_and_step(self.model, self.optimizer, self.scheduler, self.cfg.max_grad_norm)
