"""The policy (and, with train=False, the reference): log-probs and the clipped policy-gradient update.

Every model pass first spreads the samples over data-parallel groups by token count
(train/utils/dispatch.py), packs each group's samples into micro-batches (train/utils/packing.py),
and, for log-probs, sends the results back to the ranks that own the samples.

Loss normalisation does not depend on the parallel layout: every micro-batch's loss is its
*sum* divided by normalisers counted once over the whole mini-batch (all dp groups, all
micro-batches), and the loss is multiplied by the number of ranks FSDP averages over
(ddp * fsdp) to undo that averaging. Ranks of one dp group (sp, tp) compute the same loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from train.utils import algorithms as alg
from train.utils.dispatch import Dispatch
from train.utils.distributed import DistContext, all_reduce_max, all_reduce_sum
from train.utils.fused_logprobs import FusedLogprobHead
from train.utils.packing import PackedMicroBatch
from train.utils.parallel import Layout, layout_for
from train.utils.seq_parallel import gather_sequence
from train.utils.tensor_parallel import vocab_parallel_logprobs
from train.workers import base


@dataclass
class TrainBatch:
    """This rank's share of a mini-batch; per-token tensors have length len(ids) - 1."""
    ids: list[list[int]]
    action_mask: list[list[int]]
    # one float per sequence (placed on its action tokens), or one [len-1] tensor per sequence
    # (per-token advantages: GAE, REINFORCE++)
    advantages: list[float] | list[torch.Tensor]
    sampler_logp: list[torch.Tensor]
    old_logp: list[torch.Tensor] | None = None  # None: one update per rollout, ratio = 1
    ref_logp: list[torch.Tensor] | None = None


def policy_clip_range(cfg) -> tuple[float, float]:
    """(clip_low, clip_high): explicit actor.clip_low/clip_high win; otherwise PPO uses actor.clip on
    both sides and GSPO its own small sequence-level ranges (actor.gspo_clip_low/high, 3e-4/4e-4 in the paper)."""
    if cfg.loss == "gspo":
        low_default, high_default = cfg.get("gspo_clip_low", 3e-4), cfg.get("gspo_clip_high", 4e-4)
    else:
        low_default = high_default = cfg.clip
    return (cfg.clip_low if cfg.clip_low is not None else low_default,
            cfg.clip_high if cfg.clip_high is not None else high_default)


class Actor:
    def __init__(self, cfg, ctx: DistContext, model_path: str, *, pad_token_id: int, train: bool,
                 temperature: float, total_updates: int = 1, layout: Layout | None = None):
        self.cfg, self.ctx, self.pad_id, self.train = cfg, ctx, pad_token_id, train
        self.total_updates = total_updates
        self.temperature = temperature
        self.layout = layout or layout_for(cfg, ctx.world_size, ctx.device.type, "actor")
        self.model = base.load_causal_lm(model_path, device=ctx.device)
        # actor.use_liger_kernel: fused log-prob/entropy head, no [tokens, vocab] logits (train/utils/fused_logprobs.py)
        self.fused_head = FusedLogprobHead(self.model) if cfg.get("use_liger_kernel") else None
        param_dtype = cfg.dtype if ctx.device.type == "cuda" else "float32"
        base.parallelize(self.model, self.layout, param_dtype=param_dtype,
                         gradient_checkpointing=train and cfg.gradient_checkpointing,
                         offload=bool(cfg.get("offload_model")))
        self.offload_optimizer = bool(cfg.get("offload_optimizer"))
        self.infer_tokens = cfg.max_inference_length_per_device or 2 * cfg.max_length_per_device
        if train:
            self.optimizer = base.build_optimizer(self.model, cfg.lr, cfg.betas, cfg.weight_decay)
            self.scheduler = base.build_scheduler(self.optimizer, total_updates, cfg.warmup_ratio,
                                                  cfg.scheduler, cfg.min_lr_ratio)
        else:
            self.model.eval()
            self.model.requires_grad_(False)

    # -- forward ---------------------------------------------------------------------------
    def _micro_batches(self, index: list[int], ids, masks, max_tokens: int) -> list[PackedMicroBatch]:
        return base.packed_micro_batches(index, ids, masks, max_tokens, self.pad_id, self.layout, self.ctx.device)

    def _forward(self, mb: PackedMicroBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, entropy or None) as [samples, longest - 1] rows; exact on action positions, 0 elsewhere.

        Logits only where the label is an action token: prompt, tool and padding positions are
        never trained, and the LM head over them (and its backward) is most of the vocabulary work."""
        lay = self.layout
        picked = mb.loss_positions.nonzero().squeeze(-1)
        keep = picked if picked.numel() else torch.zeros(1, dtype=torch.long, device=picked.device)
        valid = mb.loss_positions[keep].float()
        labels = mb.labels[keep]
        kwargs = dict(mb.model_inputs(), use_cache=False, logits_to_keep=keep, sp_group=lay.sp_group)
        bonus = bool(self.cfg.entropy.coef or self.cfg.entropy.get("min_coef"))
        if self.fused_head is not None:  # actor.use_liger_kernel
            logp, entropy = self.fused_head(self.model, labels[None], self.temperature, with_entropy, **kwargs)
            logp, entropy = logp[0], (entropy[0] if entropy is not None else None)
        else:
            logits = self.model(**kwargs).logits[0]  # [kept, vocab] (or this tp rank's vocab slice)
            if lay.sizes.tp > 1:
                logp, entropy = vocab_parallel_logprobs(logits, labels, lay.tp_group, self.temperature, with_entropy)
            else:
                logits = logits.float()
                logp = alg.logprobs_from_logits(logits, labels, temperature=self.temperature)
                entropy = None
                if with_entropy:  # a metric unless the entropy bonus is on: no graph for it then
                    with torch.set_grad_enabled(torch.is_grad_enabled() and bonus):
                        entropy = alg.entropy_from_logits(logits / self.temperature)
        if entropy is not None and not bonus:
            entropy = entropy.detach()
        length = mb.input_ids.shape[1]

        def to_rows(values: torch.Tensor) -> torch.Tensor:
            flat = values.new_zeros(length).scatter(0, keep, values * valid)
            return mb.rows(gather_sequence(flat, lay.sp_group))

        return to_rows(logp), (to_rows(entropy) if entropy is not None else None)

    @torch.no_grad()
    def compute_logprobs(self, ids: list[list[int]], masks: list[list[int]]) -> list[torch.Tensor]:
        """log p(token t+1 | tokens <= t) for every (own) sequence, as [len-1] CPU tensors; exact on
        action positions, 0 elsewhere."""
        return base.per_sample_pass(
            ids, masks, self.layout, self.ctx.device,
            lambda index, g_ids, g_masks: self._micro_batches(index, g_ids, g_masks, self.infer_tokens),
            lambda mb: self._forward(mb, with_entropy=False)[0])

    # -- update ----------------------------------------------------------------------------
    def entropy_coef(self) -> float:
        """The entropy bonus coefficient at the current optimizer step (schedule with a floor)."""
        e = self.cfg.entropy
        total = e.get("decay_steps") or self.total_updates
        return alg.entropy_coef_schedule(self.scheduler.last_epoch, total, e.coef, e.get("min_coef") or 0.0,
                                         e.get("schedule") or "constant")

    def update(self, batch: TrainBatch, max_new_tokens: int) -> dict[str, float]:
        """`update_per_rollout` passes over the batch, `mini_batches` optimizer steps per pass.

        With `target_kl`, each mini-batch's approx_kl (old -> current policy, all ranks) is checked
        after its backward: above the target, that step is dropped and the remaining epochs are
        skipped (the decision uses all-reduced numbers, so every rank stops at the same place)."""
        cfg = self.cfg
        sums: dict[str, float] = {}
        maxima = {"ratio_max": 0.0, "sampler_ratio_max": 0.0}
        minima = {"ratio_min": float("inf")}
        grad_norms: list[float] = []
        target_kl = cfg.get("target_kl")
        check_kl = target_kl is not None and batch.old_logp is not None
        stop_epoch = None
        coefs: list[float] = []
        self.model.train()
        for epoch in range(cfg.update_per_rollout):
            for part in range(cfg.mini_batches):
                index = list(range(len(batch.ids)))[part::cfg.mini_batches]
                before = dict(sums)
                coef = self.entropy_coef()
                self.accumulate_gradients(batch, index, max_new_tokens, sums, maxima, entropy_coef=coef,
                                          minima=minima)
                if check_kl:
                    kl, tok = all_reduce_sum([sums.get("approx_kl", 0.0) - before.get("approx_kl", 0.0),
                                              sums.get("tokens", 0.0) - before.get("tokens", 0.0)], self.ctx.device)
                    if kl / max(tok, 1.0) > target_kl and grad_norms:
                        self.optimizer.zero_grad(set_to_none=True)  # this step is not taken
                        sums = before
                        stop_epoch = epoch + 1
                        break
                coefs.append(coef)
                grad_norms.append(self._optimizer_step())
            if stop_epoch is not None:
                break
        keys = sorted(sums)
        totals = dict(zip(keys, all_reduce_sum([sums[k] for k in keys], self.ctx.device)))
        tokens = max(totals.pop("tokens"), 1.0)
        metrics = {"actor/loss": totals.pop("loss") / len(grad_norms)}
        metrics.update({f"actor/{k}": v / tokens for k, v in totals.items()})
        metrics.update({f"actor/{k}": all_reduce_max(v, self.ctx.device) for k, v in maxima.items()})
        for k, v in minima.items():
            low = -all_reduce_max(-v, self.ctx.device)
            if low != float("inf"):  # inf: no action token on any rank
                metrics[f"actor/{k}"] = low
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["actor/grad_norm_max"] = max(grad_norms)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["actor/entropy_coef"] = coefs[-1]
        metrics["actor/optimizer_steps"] = float(len(grad_norms))
        if target_kl is not None:
            metrics["actor/early_stopped"] = float(stop_epoch is not None)
            metrics["actor/epochs"] = float(stop_epoch or cfg.update_per_rollout)
            if stop_epoch is not None:
                metrics["actor/stop_epoch"] = float(stop_epoch)
        return metrics

    def _group_batch(self, batch: TrainBatch, index: list[int]) -> tuple[TrainBatch, bool]:
        """This rank's samples `index` -> the samples of its dp group (see Dispatch), and whether
        advantages are per token (decided over all ranks: a rank may have no samples)."""
        token_adv = bool(all_reduce_max(float(bool(index) and isinstance(batch.advantages[index[0]], torch.Tensor)),
                                        self.ctx.device))
        fields = {"ids": [torch.tensor(batch.ids[i]) for i in index],
                  "mask": [torch.tensor(batch.action_mask[i]) for i in index],
                  "adv": [batch.advantages[i] if token_adv else torch.tensor([batch.advantages[i]]) for i in index],
                  "sampler": [batch.sampler_logp[i] for i in index]}
        for name, per_sample in (("old", batch.old_logp), ("ref", batch.ref_logp)):
            if per_sample is not None:  # None on every rank alike (set by the config)
                fields[name] = [per_sample[i] for i in index]
        got = Dispatch([len(batch.ids[i]) for i in index], self.layout, self.ctx.device).scatter(fields)
        floats = {name: [t.float() for t in got[name]] for name in ("adv", "sampler", "old", "ref") if name in got}
        adv = floats["adv"] if token_adv else [float(t[0]) for t in got["adv"]]
        return TrainBatch(base.token_lists(got["ids"]), base.token_lists(got["mask"]), adv, floats["sampler"],
                          floats.get("old"), floats.get("ref")), token_adv

    def accumulate_gradients(self, batch: TrainBatch, index: list[int], max_new_tokens: int,
                             sums: dict[str, float], maxima: dict[str, float], *,
                             entropy_coef: float | None = None, minima: dict[str, float] | None = None) -> None:
        """Backward over this rank's samples `index` of one mini-batch; gradients summed into .grad.
        Metric sums are added by one rank per dp group (the others see the same samples)."""
        cfg = self.cfg
        clip_low, clip_high = policy_clip_range(cfg)
        norm_len = cfg.loss_norm_length or max_new_tokens
        kl_in_loss = cfg.kl.coef > 0 and cfg.kl.reward_estimator is None
        ent_coef = cfg.entropy.coef if entropy_coef is None else entropy_coef
        batch, token_adv = self._group_batch(batch, index)
        leader = self.layout.is_data_leader
        group = range(len(batch.ids))
        n_tok, n_seq = all_reduce_sum(
            [float(sum(sum(batch.action_mask[i][1:]) for i in group)) if leader else 0.0,
             float(len(batch.ids)) if leader else 0.0], self.ctx.device)
        local: dict[str, float] = {}
        for mb in self._micro_batches(list(group), batch.ids, batch.action_mask, cfg.max_length_per_device):
            logp, entropy = self._forward(mb, with_entropy=True)
            mask = mb.action_mask
            if token_adv:
                adv = mb.pad_token_tensor(batch.advantages).to(logp.device) * mask
                adv_seq = adv  # GSPO-token: per-token advantages
            else:
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
                token_loss = token_loss * alg.tis_weights(old, sampler, mask, cfg.tis_cap,
                                                          level=cfg.get("tis_level") or "token")
            if ent_coef:
                token_loss = token_loss - ent_coef * entropy * mask
            if kl_in_loss:
                ref = mb.pad_token_tensor(batch.ref_logp).to(logp.device)
                kl = alg.kl_estimate(logp, ref, cfg.kl.type) * mask
                token_loss = token_loss + cfg.kl.coef * kl
                self._add(local, "kl", kl.detach().sum())
            loss = alg.aggregate_loss(token_loss, mask, cfg.agg_mode, n_tokens_global=max(n_tok, 1.0),
                                      n_seqs_global=max(n_seq, 1.0), max_len_norm=norm_len)
            # FSDP averages gradients over ddp * fsdp ranks; our normalisers are already global.
            (loss * self.layout.grad_scale).backward()
            # Metrics as token-weighted sums; the caller divides by the global token count.
            n_mask = mask.sum()
            self._add(local, "loss", loss.detach())
            self._add(local, "entropy", (entropy.detach() * mask).sum())
            self._add(local, "clip_fraction", float(stats["clip_fraction"]) * n_mask)
            self._add(local, "approx_kl", float(stats["approx_kl"]) * n_mask)
            # Sampler vs trainer at the sampling weights: old log-probs when recomputed, else this
            # forward (one update per rollout: nothing has changed the weights yet).
            diff = (sampler - old) * mask  # log(sampler / trainer) on action tokens
            self._add(local, "sampler_kl", ((torch.exp(-diff) - 1 + diff) * mask).sum())
            self._add(local, "sampler_abs_diff", diff.abs().sum())
            self._add(local, "tokens", n_mask)
            if n_mask > 0:
                maxima["ratio_max"] = max(maxima.get("ratio_max", 0.0), float(stats["ratio_max"]))
                if minima is not None:
                    minima["ratio_min"] = min(minima.get("ratio_min", float("inf")), float(stats["ratio_min"]))
                ratio = torch.exp(old - sampler)[mask > 0]
                maxima["sampler_ratio_max"] = max(maxima.get("sampler_ratio_max", 0.0), float(ratio.max()))
        for key, value in local.items():
            sums[key] = sums.get(key, 0.0) + (value if leader else 0.0)

    @staticmethod
    def _add(sums: dict[str, float], key: str, value) -> None:
        sums[key] = sums.get(key, 0.0) + float(value)

    def _optimizer_step(self) -> float:
        return base.clip_and_step(self.model, self.optimizer, self.scheduler, self.cfg.max_grad_norm,
                                  offload_optimizer=self.offload_optimizer)

    def named_full_tensors(self):
        return base.full_named_tensors(self.model)
