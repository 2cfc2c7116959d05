"""The policy (and, with train=False, the reference): log-probs and the clipped policy-gradient update,
both over the step batch (train/parallel/step_batch.py) that this rank's dp group holds.

Loss normalisation does not depend on the parallel layout: every micro-batch's loss is its *sum*
divided by normalisers counted once over the whole mini-batch (all dp groups, all micro-batches),
and the loss is multiplied by the number of ranks FSDP averages over (ddp * fsdp) to undo that
averaging (train/models/trainable.py). Ranks of one dp group (sp, tp) compute the same loss.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from train.algorithms.aggregation import aggregate_loss
from train.algorithms.kl import kl_estimate
from train.algorithms.logits import head_logprobs_entropy
from train.algorithms.mismatch import mis_keep, sampler_mismatch_sums, tis_weights
from train.algorithms.policy_loss import POLICY_LOSSES, LossSettings
from train.algorithms.schedules import entropy_coef_schedule
from train.models import optim
from train.models.config import ActorConfig, compute_dtype, entropy_in_loss, replaced
from train.models.lora import LoraSettings, adapters_disabled
from train.models.memory_settings import BuildRoom, decided_memory_settings
from train.models.model_init import build_model
from train.models.router_replay import RouterBalance, RouterReplay
from train.models.trainable import Norms, Trainable, UpdateStats
from train.models.vlm import VisionSpec, is_vision_config, vision_tower
from train.parallel.collectives import all_reduce_sum
from train.parallel.distributed import DistContext
from train.parallel.fused_logprobs import FusedLogprobHead
from train.parallel.layout import Layout, layout_for
from train.parallel.packing import PackedMicroBatch
from train.parallel.parallelize import DTYPES
from train.parallel.step_batch import StepBatch
from train.parallel.tensor_parallel import vocab_parallel_logprobs


def loss_settings(cfg: ActorConfig) -> LossSettings:
    """The policy loss's settings from `actor.*`. The clip range: explicit actor.clip_low/clip_high win;
    otherwise PPO (and the others) use actor.clip on both sides, GSPO its own small sequence-level ranges
    (actor.gspo_clip_low/high, 3e-4/4e-4 in the paper) and CISPO its IS-weight range
    (actor.cispo_clip_low/high: no floor, 1 + 5)."""
    if cfg.loss == "gspo":
        low_default, high_default = cfg.gspo_clip_low, cfg.gspo_clip_high
    elif cfg.loss == "cispo":  # no floor by default: 1 - 1 = 0, and a weight is never below 0
        low_default, high_default = (cfg.cispo_clip_low if cfg.cispo_clip_low is not None else 1.0), cfg.cispo_clip_high
    else:
        low_default = high_default = cfg.clip
    return LossSettings(clip_low=cfg.clip_low if cfg.clip_low is not None else low_default,
                        clip_high=cfg.clip_high if cfg.clip_high is not None else high_default,
                        dual_clip=cfg.dual_clip, ratio_cap=cfg.dppo_ratio_cap, tau_pos=cfg.sapo_tau_pos,
                        tau_neg=cfg.sapo_tau_neg, dro_beta=cfg.dro_beta, cov_ratio=cfg.cov_ratio, cov_low=cfg.cov_low,
                        cov_high=cfg.cov_high, kl_cov_coef=cfg.kl_cov_coef)


# actor/sampler_kl_lag{j}: the sampler-trainer KL of the tokens sampled j weight versions before the trainer's
# (the last bucket: that many or more), with asynchronous rollouts.
LAG_BUCKETS = 5


class Actor(Trainable):
    def __init__(self, cfg: ActorConfig, ctx: DistContext, model_path: str, *, pad_token_id: int, train: bool,
                 temperature: float, total_updates: int = 1, layout: Layout | None = None, adapter_seed: int = 0,
                 reserved_bytes: int | Callable[[], int] = 0,
                 awake_engine_bytes: int | Callable[[], int] | None = None):
        layout = layout or layout_for(cfg, ctx.world_size, ctx.device.type, "actor")
        # null settings decided here, once: `self.cfg` holds the values the actor runs with
        cfg = replaced(cfg, dtype=compute_dtype(cfg.dtype, ctx.device.type))
        head_asked = cfg.use_liger_kernel
        cfg, self.memory_note, self.recompute_above = decided_memory_settings(
            cfg, BuildRoom(ctx, model_path, reserved_bytes, awake_engine_bytes), layout, train)
        super().__init__(layout, ctx.device, pad_token_id, cfg.max_length_per_device,
                         cfg.max_inference_length_per_device or 2 * cfg.max_length_per_device,
                         cfg.max_grad_norm, bool(cfg.offload_optimizer),
                         bool(cfg.offload_model))
        self.cfg, self.ctx, self.train = cfg, ctx, train
        self.total_updates = total_updates
        self.temperature = temperature
        self.kl_coef = cfg.kl.coef  # the KL penalty's weight now (trainer.forgetting.action=raise_kl raises it)
        # actor.lora: adapters on a frozen base (a reference, train=False, is always the plain model)
        self.lora = LoraSettings.from_config(cfg.lora) if train else LoraSettings()
        # Built on the meta device and filled shard by shard: no rank ever holds the whole model.
        self.model = build_model(model_path, self.layout, ctx.device,
                                 param_dtype=cfg.dtype,
                                 gradient_checkpointing=train and cfg.gradient_checkpointing,
                                 offload=bool(cfg.offload_model), lora=self.lora, adapter_seed=adapter_seed,
                                 compile_layers=bool(cfg.compile), frozen=not train,
                                 master_weights=bool(cfg.master_weights))
        if train and cfg.freeze_vision:  # a vision-language actor that keeps its image encoder as it is
            vision_tower(self.model).requires_grad_(False)
        if cfg.master_weights:  # bf16 weights, fp32 masters cast into them once per optimizer step
            self.use_master_weights(DTYPES[cfg.dtype])
        # A vision-language model's placeholder tokens have probability 0, as in the engine
        # (train/algorithms/logits.py mask_unsampled).
        config = self.model.config
        self.unsampled = (torch.tensor(VisionSpec.from_config(config).unsampled_ids, device=ctx.device)
                          if is_vision_config(config) else None)
        # actor.use_liger_kernel: fused log-prob/entropy head, no [tokens, vocab] logits (train/parallel/fused_logprobs.py)
        self.fused_head = None
        if cfg.use_liger_kernel:
            try:
                self.fused_head = FusedLogprobHead(self.model)
            except ValueError:
                if head_asked:  # asked for (true), not chosen (null): say why it cannot be
                    raise
                self.cfg = cfg = replaced(cfg, use_liger_kernel=False)
        # Mixtures of experts (train/models/router_replay.py): the sampler's expert choices replayed in every
        # forward of the trained policy (actor.router_replay), the routers' load-balancing loss.
        self.replay = RouterReplay(self.model) if train and cfg.router_replay else None
        self.balance = RouterBalance(self.model) if train and cfg.router_aux_loss_coef > 0 else None
        self.optimizer = self.scheduler = None
        self.last_entropy_coef = 0.0
        if train:
            self.optimizer = optim.build_optimizer(self.trained, cfg.lr, cfg.betas, cfg.weight_decay)
            self.scheduler = optim.build_scheduler(self.optimizer, total_updates, cfg.warmup_ratio,
                                                  cfg.scheduler, cfg.min_lr_ratio)
        else:
            self.model.eval()
            self.model.requires_grad_(False)

    @property
    def entropy_in_loss(self) -> bool:
        """Whether the loss takes the entropy's gradient (config.entropy_in_loss of actor.entropy)."""
        return entropy_in_loss(self.cfg.entropy)

    @property
    def keeps_logits(self) -> bool:
        """The plain head's [tokens, vocab] logits (the fused one keeps none): what the memory plan counts."""
        return self.fused_head is None

    # -- forward ---------------------------------------------------------------------------
    def _forward(self, mb: PackedMicroBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, entropy or None) as [samples, longest - 1] rows; exact on action positions, 0 elsewhere.

        Logits only where the label is an action token: prompt, tool and padding positions are
        never trained, and the LM head over them (and its backward) is most of the vocabulary work."""
        lay = self.layout
        if "keep" not in mb.cache:
            picked = mb.loss_positions.nonzero().squeeze(-1)
            keep = picked if picked.numel() else torch.zeros(1, dtype=torch.long, device=picked.device)
            mb.cache["keep"] = (keep, mb.loss_positions[keep].float(), mb.labels[keep])
        keep, valid, labels = mb.cache["keep"]
        kwargs = dict(mb.model_inputs(), use_cache=False, logits_to_keep=keep, **lay.attention_groups())
        if self.replay is not None:
            self.replay.set(mb.routes)  # kept until the next forward: a checkpointed backward recomputes with it
        if self.balance is not None:
            self.balance.clear()
        bonus = self.entropy_in_loss
        if self.fused_head is not None:  # actor.use_liger_kernel
            logp, entropy = self.fused_head(self.model, labels[None], self.temperature, with_entropy, **kwargs)
            logp, entropy = logp[0], (entropy[0] if entropy is not None else None)
        else:
            logits = self.model(**kwargs).logits[0]  # [kept, vocab] (or this tp rank's vocab slice)
            if lay.sizes.tp > 1:
                logp, entropy = vocab_parallel_logprobs(logits, labels, lay.tp_group, self.temperature, with_entropy)
            else:
                logp, entropy = head_logprobs_entropy(logits, labels, self.temperature, unsampled=self.unsampled,
                                                      with_entropy=with_entropy, entropy_grad=bonus)
        if entropy is not None and not bonus:
            entropy = entropy.detach()
        length = mb.input_ids.shape[1]

        def to_rows(values: torch.Tensor) -> torch.Tensor:
            flat = values.new_zeros(length).scatter(0, keep, values * valid)
            return mb.rows(mb.whole_row(flat, lay.sp_group))

        return to_rows(logp), (to_rows(entropy) if entropy is not None else None)

    def compute_logprobs(self, batch: StepBatch, positions: list[int] | None = None) -> list[torch.Tensor]:
        """log p(token t+1 | tokens <= t) of every sample of the batch (or of those at `positions`; None
        for the others), as [len-1] CPU tensors; exact on action positions, 0 elsewhere."""
        try:
            return self.per_token_pass(batch, lambda mb: self._forward(mb, with_entropy=False)[0], positions)
        finally:
            self._unroute()

    def _unroute(self) -> None:
        """After a pass: the routers route themselves again (other callers of the model: export, probes)."""
        if self.replay is not None:
            self.replay.clear()
        if self.balance is not None:
            self.balance.clear()

    # -- update ----------------------------------------------------------------------------
    def entropy_coef(self) -> float:
        """The entropy bonus coefficient at the current optimizer step (schedule with a floor)."""
        e = self.cfg.entropy
        return entropy_coef_schedule(self.scheduler.last_epoch, e.decay_steps or self.total_updates, e.coef,
                                     e.min_coef, e.schedule)

    def policy_loss(self, batch: StepBatch, max_new_tokens: int):
        """The loss hook: one packed micro-batch's share of the mini-batch's policy loss, and its metric sums."""
        cfg = self.cfg
        settings = loss_settings(cfg)
        norm_len = cfg.loss_norm_length or max_new_tokens
        kl_in_loss = cfg.kl.coef > 0 and cfg.kl.reward_estimator is None
        old_logp = batch.fields.get("old_logp")  # None: one update per rollout, ratio = 1
        clipped_loss = POLICY_LOSSES.get(cfg.loss)  # actor.loss: ppo, gspo, ... (train/algorithms/policy_loss.py)
        lagged = "sampler_lag" in batch.fields  # each token's version gap (asynchronous rollouts)

        def loss(mb: PackedMicroBatch, norms: Norms, stats: UpdateStats) -> torch.Tensor:
            coef = self.last_entropy_coef = self.entropy_coef()
            logp, entropy = self._forward(mb, with_entropy=True)
            mask = mb.action_mask
            adv = mb.gather(batch.fields["advantages"], "advantages")
            old = mb.gather(old_logp, "old_logp") if old_logp is not None else logp.detach()
            token_loss, st = clipped_loss(logp, old, adv, mask, settings)
            sampler = mb.gather(batch.sampler_logp, "sampler_logp")
            if cfg.tis_cap is not None:
                weights = tis_weights(old, sampler, mask, cfg.tis_cap, level=cfg.tis_level)
                token_loss = token_loss * weights
                stats.add("tis_clipped", ((weights >= cfg.tis_cap * (1 - 1e-6)) * mask).sum())
            if cfg.mis_level is not None:  # masked IS: tokens (or samples) too far off the sampler get no gradient
                keep = mis_keep(old, sampler, mask, cfg.mis_low, cfg.mis_high, level=cfg.mis_level)
                token_loss = token_loss * keep
                stats.add("mis_masked", (mask * (1.0 - keep)).sum())
            if coef:
                token_loss = token_loss - coef * entropy * mask
            if kl_in_loss:
                kl = kl_estimate(logp, mb.gather(batch.fields["ref_logp"], "ref_logp"), cfg.kl.type) * mask
                token_loss = token_loss + self.kl_coef * kl
                stats.add("kl", kl.detach().sum())
            value = aggregate_loss(token_loss, mask, cfg.agg_mode, n_tokens_global=norms.tokens,
                                   n_seqs_global=norms.seqs, max_len_norm=norm_len)
            # Metrics as token-weighted sums; the caller divides by the global token count.
            n_mask = mask.sum()
            if self.balance is not None:  # the pack's load-balancing loss, weighted by its share of the action tokens
                chunk = mb.input_ids.shape[1]  # this sp rank's positions: the real ones are the row's first laid_out
                aux = self.balance.loss(min(max(mb.laid_out - self.layout.sp_rank * chunk, 0), chunk), mb.laid_out,
                                        self.layout.sp_group)
                value = value + cfg.router_aux_loss_coef * aux * (n_mask / norms.tokens)
                stats.add("router_aux_loss", aux.detach() * n_mask)
            stats.add("loss", value.detach())
            stats.add("entropy", (entropy.detach() * mask).sum())
            stats.add("clip_fraction", st["clip_fraction"] * n_mask)
            stats.add("approx_kl", st["approx_kl"] * n_mask)
            # Sampler vs trainer at the sampling weights: old log-probs when recomputed, else this
            # forward (one update per rollout: nothing has changed the weights yet).
            mismatch = sampler_mismatch_sums(old, sampler, mask)
            stats.add("sampler_kl", mismatch["kl"])
            if lagged:  # the same, per version gap between each token's sampler and the trainer
                lag = mb.gather(batch.fields["sampler_lag"], "sampler_lag")
                for j in range(LAG_BUCKETS):
                    at = mask * ((lag >= j) if j == LAG_BUCKETS - 1 else (lag == j))
                    stats.add(f"sampler_kl_lag{j}", sampler_mismatch_sums(old, sampler, at)["kl"])
                    stats.add(f"tokens_lag{j}", at.sum())
            stats.add("sampler_abs_diff", mismatch["abs_diff"])
            stats.add("tokens", n_mask)
            stats.add("laid_out", float(mb.laid_out))
            stats.add("represented", float(mb.represented))
            # (-inf without action tokens: ratio_extremes' identities, so no check that reads the device)
            stats.max("ratio_max", st["ratio_max"])
            stats.max("neg_ratio_min", -st["ratio_min"])
            stats.max("sampler_ratio_max", mismatch["max_ratio"])
            return value

        return loss

    def update(self, batch: StepBatch, max_new_tokens: int) -> dict[str, float]:
        """`actor.update_per_rollout` passes over the batch, `mini_batches` optimizer steps per pass.

        With `target_kl`, each mini-batch's approx_kl (old -> current policy, all ranks) is checked
        after its backward: above the target, that step is dropped and the remaining epochs are
        skipped (the decision uses all-reduced numbers, so every rank stops at the same place)."""
        cfg = self.cfg
        stopped: list[int] = []

        def check_kl(epoch: int, sums: dict[str, float], steps_taken: int) -> bool:
            kl, tok = all_reduce_sum([sums.get("approx_kl", 0.0), sums.get("tokens", 0.0)], self.device)
            if kl / max(tok, 1.0) > cfg.target_kl and steps_taken:
                stopped.append(epoch + 1)
                return True
            return False

        checked = cfg.target_kl is not None and "old_logp" in batch.fields
        square_before = self.local_weight_square()
        try:
            stats = self.run_update(batch, cfg.update_per_rollout, cfg.mini_batches,
                                    self.policy_loss(batch, max_new_tokens), after_backward=check_kl if checked else None)
        finally:
            self._unroute()
        sum_keys = ("loss", "entropy", "clip_fraction", "approx_kl", "sampler_kl", "sampler_abs_diff", "tokens",
                    "laid_out", "represented")
        if cfg.tis_cap is not None:
            sum_keys += ("tis_clipped",)  # the fraction of action tokens whose IS weight hit the cap
        if cfg.mis_level is not None:
            sum_keys += ("mis_masked",)  # the fraction of action tokens masked out by actor.mis_*
        if cfg.kl.coef > 0 and cfg.kl.reward_estimator is None:
            sum_keys += ("kl",)
        if self.balance is not None:
            sum_keys += ("router_aux_loss",)  # the routers' load-balancing loss, action-token weighted
        lagged = "sampler_lag" in batch.fields
        if lagged:
            sum_keys += tuple(f"{k}_lag{j}" for j in range(LAG_BUCKETS) for k in ("sampler_kl", "tokens"))
        metrics = self.reduce(stats, "actor", sum_keys, ("ratio_max", "neg_ratio_min", "sampler_ratio_max"))
        for j in range(LAG_BUCKETS if lagged else 0):  # (both sums were divided by the same token count)
            share, kl = metrics.pop(f"actor/tokens_lag{j}"), metrics.pop(f"actor/sampler_kl_lag{j}")
            if share > 0:
                metrics[f"actor/sampler_kl_lag{j}"] = kl / share
                metrics[f"actor/tokens_share_lag{j}"] = share
        metrics["actor/entropy_coef"] = self.last_entropy_coef
        if self.recompute_stats is not None:  # checkpointing by pack length (recompute_above): this update's choice
            metrics["actor/recompute_limit"], metrics["actor/recompute_fraction"] = self.recompute_stats
        if cfg.kl.coef > 0:
            metrics["actor/kl_coef"] = self.kl_coef
        # Tokens the update's passes computed per token its samples hold: 1.0 unshared, less when a
        # group's prompt is laid out once (actor.share_prompt).
        laid_out, represented = metrics.pop("actor/laid_out"), metrics.pop("actor/represented")
        metrics["actor/tokens_computed_ratio"] = laid_out / max(represented, 1e-12)
        # How far the update moved the weights: lr=1e3 shows as a change of ~1000x, a healthy step as ~1e-4.
        before, after = (x ** 0.5 for x in all_reduce_sum([square_before, self.local_weight_square()], self.device))
        metrics["actor/weight_norm"] = after
        metrics["actor/weight_change"] = abs(after - before) / max(before, 1e-12)
        if cfg.target_kl is not None:
            metrics["actor/early_stopped"] = float(bool(stopped))
            metrics["actor/epochs"] = float(stopped[0] if stopped else cfg.update_per_rollout)
            if stopped:
                metrics["actor/stop_epoch"] = float(stopped[0])
        return metrics


class AdapterFreeReference:
    """The KL reference of a LoRA actor (`actor.lora.rank > 0`): the actor's own module with its
    adapters switched off, which is the base model. No second copy of the weights, and its passes run
    on the actor's step batch (the same layout)."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor
        self.layout = actor.layout

    def compute_logprobs(self, batch: StepBatch) -> list[torch.Tensor]:
        with adapters_disabled(self.actor.model):
            return self.actor.compute_logprobs(batch)
