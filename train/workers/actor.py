"""The policy (and, with train=False, the reference): log-probs and the clipped policy-gradient update.

Loss normalisation does not depend on the parallel layout: every micro-batch's loss is its
*sum* divided by normalisers counted over the whole mini-batch on all data-parallel ranks, and
the loss is multiplied by the data-parallel size to undo FSDP's gradient averaging.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from train.utils import algorithms as alg
from train.utils.batching import MicroBatch, build_micro_batch, plan_micro_batches
from train.utils.distributed import DistContext, all_reduce_max, all_reduce_sum
from train.workers import base


@dataclass
class TrainBatch:
    """This rank's share of a mini-batch; per-token tensors have length len(ids) - 1."""
    ids: list[list[int]]
    action_mask: list[list[int]]
    advantages: list[float]  # one per sequence, placed on its action tokens
    sampler_logp: list[torch.Tensor]
    old_logp: list[torch.Tensor] | None = None  # None: one update per rollout, ratio = 1
    ref_logp: list[torch.Tensor] | None = None


class Actor:
    def __init__(self, cfg, ctx: DistContext, model_path: str, *, pad_token_id: int, train: bool,
                 temperature: float, total_updates: int = 1):
        self.cfg, self.ctx, self.pad_id, self.train = cfg, ctx, pad_token_id, train
        self.temperature = temperature
        self.model = base.load_causal_lm(model_path, device=ctx.device)
        if train and cfg.gradient_checkpointing:
            base.apply_ac(self.model)
        param_dtype = cfg.dtype if ctx.device.type == "cuda" else "float32"
        base.apply_fsdp(self.model, ctx.mesh, param_dtype=param_dtype)
        self.infer_tokens = cfg.max_inference_length_per_device or 2 * cfg.max_length_per_device
        if train:
            self.optimizer = base.build_optimizer(self.model, cfg.lr, cfg.betas, cfg.weight_decay)
            self.scheduler = base.build_scheduler(self.optimizer, total_updates, cfg.warmup_ratio,
                                                  cfg.scheduler, cfg.min_lr_ratio)
        else:
            self.model.eval()
            self.model.requires_grad_(False)

    # -- forward ---------------------------------------------------------------------------
    def _micro_batches(self, index: list[int], ids, masks, max_tokens: int) -> list[MicroBatch]:
        plan = [[index[j] for j in g] for g in plan_micro_batches([len(ids[i]) for i in index], max_tokens)]
        # Every rank must run as many forwards as the busiest one (FSDP collectives).
        n = int(all_reduce_max(len(plan), self.ctx.device))
        plan += [[] for _ in range(n - len(plan))]
        return [build_micro_batch(g, ids, masks, self.pad_id, self.ctx.device) for g in plan]

    def _forward(self, mb: MicroBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        logits = logits[:, :-1].float()
        logp = alg.logprobs_from_logits(logits, mb.labels, temperature=self.temperature)
        entropy = alg.entropy_from_logits(logits / self.temperature) if with_entropy else None
        return logp, entropy

    @torch.no_grad()
    def compute_logprobs(self, ids: list[list[int]], masks: list[list[int]]) -> list[torch.Tensor]:
        """log p(token t+1 | tokens <= t) for every sequence, as [len-1] CPU tensors."""
        out: list[torch.Tensor | None] = [None] * len(ids)
        for mb in self._micro_batches(list(range(len(ids))), ids, masks, self.infer_tokens):
            logp, _ = self._forward(mb, with_entropy=False)
            for row, i in enumerate(mb.index):
                out[i] = logp[row, : len(ids[i]) - 1].cpu()
        return out

    # -- update ----------------------------------------------------------------------------
    def update(self, batch: TrainBatch, max_new_tokens: int) -> dict[str, float]:
        """`update_per_rollout` passes over the batch, `mini_batches` optimizer steps per pass."""
        cfg = self.cfg
        sums: dict[str, float] = {}
        maxima = {"ratio_max": 0.0, "sampler_ratio_max": 0.0}
        grad_norms: list[float] = []
        self.model.train()
        for _ in range(cfg.update_per_rollout):
            for part in range(cfg.mini_batches):
                index = list(range(len(batch.ids)))[part::cfg.mini_batches]
                self.accumulate_gradients(batch, index, max_new_tokens, sums, maxima)
                grad_norms.append(self._optimizer_step())
        keys = sorted(sums)
        totals = dict(zip(keys, all_reduce_sum([sums[k] for k in keys], self.ctx.device)))
        tokens = max(totals.pop("tokens"), 1.0)
        metrics = {"actor/loss": totals.pop("loss") / len(grad_norms)}
        metrics.update({f"actor/{k}": v / tokens for k, v in totals.items()})
        metrics.update({f"actor/{k}": all_reduce_max(v, self.ctx.device) for k, v in maxima.items()})
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def accumulate_gradients(self, batch: TrainBatch, index: list[int], max_new_tokens: int,
                             sums: dict[str, float], maxima: dict[str, float]) -> None:
        """Backward over this rank's samples `index` of one mini-batch; gradients summed into .grad."""
        cfg = self.cfg
        clip_low = cfg.clip_low if cfg.clip_low is not None else cfg.clip
        clip_high = cfg.clip_high if cfg.clip_high is not None else cfg.clip
        norm_len = cfg.loss_norm_length or max_new_tokens
        kl_in_loss = cfg.kl.coef > 0 and cfg.kl.reward_estimator is None
        n_tok, n_seq = all_reduce_sum(
            [float(sum(sum(batch.action_mask[i][1:]) for i in index)), float(len(index))], self.ctx.device)
        for mb in self._micro_batches(index, batch.ids, batch.action_mask, cfg.max_length_per_device):
            logp, entropy = self._forward(mb, with_entropy=True)
            mask = mb.action_mask
            adv_seq = torch.tensor([batch.advantages[i] for i in mb.index] or [0.0], device=logp.device)
            adv = alg.broadcast_to_tokens(adv_seq, mask)
            old = (mb.pad_token_tensor(batch.old_logp).to(logp.device) if batch.old_logp is not None
                   else logp.detach())
            if cfg.loss == "gspo":
                token_loss, stats = alg.gspo_loss(logp, old, adv_seq, mask, clip_low, clip_high)
            else:
                token_loss, stats = alg.ppo_clip_loss(logp, old, adv, mask, clip_low, clip_high,
                                                      dual_clip=cfg.dual_clip)
            sampler = mb.pad_token_tensor(batch.sampler_logp).to(logp.device)
            if cfg.tis_cap is not None:
                token_loss = token_loss * alg.tis_weights(old, sampler, mask, cfg.tis_cap)
            if cfg.entropy.coef:
                token_loss = token_loss - cfg.entropy.coef * entropy * mask
            if kl_in_loss:
                ref = mb.pad_token_tensor(batch.ref_logp).to(logp.device)
                kl = alg.kl_estimate(logp, ref, cfg.kl.type) * mask
                token_loss = token_loss + cfg.kl.coef * kl
                self._add(sums, "kl", kl.detach().sum())
            loss = alg.aggregate_loss(token_loss, mask, cfg.agg_mode, n_tokens_global=max(n_tok, 1.0),
                                      n_seqs_global=max(n_seq, 1.0), max_len_norm=norm_len)
            # x world size: FSDP averages gradients over ranks, our normalisers are already global.
            (loss * self.ctx.world_size).backward()
            # Metrics as token-weighted sums; the caller divides by the global token count.
            n_mask = mask.sum()
            self._add(sums, "loss", loss.detach())
            self._add(sums, "entropy", (entropy.detach() * mask).sum())
            self._add(sums, "clip_fraction", float(stats["clip_fraction"]) * n_mask)
            self._add(sums, "approx_kl", float(stats["approx_kl"]) * n_mask)
            diff = (sampler - logp.detach()) * mask  # log(sampler / trainer) on action tokens
            self._add(sums, "sampler_kl", ((torch.exp(-diff) - 1 + diff) * mask).sum())
            self._add(sums, "sampler_abs_diff", diff.abs().sum())
            self._add(sums, "tokens", n_mask)
            if n_mask > 0:
                maxima["ratio_max"] = max(maxima.get("ratio_max", 0.0), float(stats["ratio_max"]))
                ratio = torch.exp(logp.detach() - sampler)[mask > 0]
                maxima["sampler_ratio_max"] = max(maxima.get("sampler_ratio_max", 0.0), float(ratio.max()))

    @staticmethod
    def _add(sums: dict[str, float], key: str, value) -> None:
        sums[key] = sums.get(key, 0.0) + float(value)

    def _optimizer_step(self) -> float:
        # clip_grad_norm_ over DTensor grads reduces across all shards: a global norm.
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if torch.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return float(norm)

    def named_full_tensors(self):
        return base.full_named_tensors(self.model)
