"""What the actor and the critic share: a model wrapped for its layout, its optimizer and scheduler,
no-grad passes over a step batch, and one update loop with the loss as a hook.

The update loop: `epochs` passes over the batch, `mini_batches` optimizer steps per pass. Each
mini-batch's samples (on this dp group) are packed into micro-batches once and reused by every
epoch; ranks with fewer packs run empty ones, so FSDP's collectives stay in step. Loss normalisers
are counted once over the whole mini-batch (every dp group, every micro-batch) before the loop,
in one all-reduce for all mini-batches; the loss is multiplied by the number of ranks FSDP averages
over (`layout.grad_scale`). Metric sums from one rank per dp group are reduced once at the end.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import FSDPModule
from transformers.modeling_layers import GradientCheckpointingLayer

from train.models import optim
from train.models.master_weights import MasterWeights
from train.models.memory_plan import HEADROOM, count_parameters, free_device_bytes, longest_fitting, working_bytes
from train.models.vlm import VisionSpec, image_spans, is_vision_config, mrope_positions
from train.parallel.collectives import all_reduce_max_many, all_reduce_sum
from train.parallel.layout import Layout
from train.parallel.packing import (PackedMicroBatch, SampleMedia, build_packed, keyed_ids, plan_packs, prompt_units,
                                    unit_length)
from train.parallel.shard_norms import local_pieces, local_square_sum
from train.parallel.step_batch import StepBatch
from train.utils.image_inputs import ImageInputs


@dataclass
class Norms:
    """A mini-batch's global loss normalisers: action tokens and sequences over every dp group."""
    tokens: float
    seqs: float


@dataclass
class UpdateStats:
    """Metric sums (one rank per dp group adds), maxima (this rank's), optimizer steps' grad norms.

    Values may be device tensors: they are added on their device in float64 (the sums Python floats would give)
    and read in one copy by `settle`, so a pack's metrics do not stop the host until the GPU has caught up (a
    dozen reads of device values per pack before)."""
    sums: dict[str, float | torch.Tensor] = field(default_factory=dict)
    maxima: dict[str, float | torch.Tensor] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)

    def add(self, key: str, value: float | torch.Tensor) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().double()
        self.sums[key] = self.sums.get(key, 0.0) + value

    def max(self, key: str, value: float | torch.Tensor) -> None:
        old = self.maxima.get(key)
        if isinstance(value, torch.Tensor):
            value = value.detach().double()
            if old is not None:
                value = torch.maximum(value, torch.as_tensor(old, dtype=torch.float64, device=value.device))
            self.maxima[key] = value
        else:
            self.maxima[key] = value if old is None else max(old, value)

    def settle(self) -> None:
        """Every device value read to the host as a float, in one copy per device."""
        by_device: dict[torch.device, list] = {}
        for d in (self.sums, self.maxima):
            for k, v in d.items():
                if isinstance(v, torch.Tensor):
                    by_device.setdefault(v.device, []).append((d, k))
        for keys in by_device.values():
            for (d, k), v in zip(keys, torch.stack([d[k] for d, k in keys]).tolist()):
                d[k] = v


LossHook = Callable[[PackedMicroBatch, Norms, UpdateStats], torch.Tensor]


class Trainable:
    """Subclasses set model, optimizer, scheduler and the config keys (see Actor, Critic)."""

    model: torch.nn.Module
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    # bf16 weights with fp32 masters, cast once per optimizer step (one process, train/models/master_weights.py)
    masters: MasterWeights | None = None
    optimizer: torch.optim.Optimizer | None = None
    keeps_logits = False  # whether its loss reads [tokens, vocab] logits (the actor's plain head)
    lm_head = True  # whether it ends in the vocabulary head (a critic's value head: False)
    entropy_in_loss = False  # whether its loss takes the entropy's gradient (the head's backward holds more)
    # with activation checkpointing: micro-batches of at most this many tokens (on the busiest rank) keep their
    # activations and skip the recompute (None: every micro-batch recomputes; memory_plan.recompute_above)
    recompute_above: int | None = None
    _checkpointed: list[torch.nn.Module] | None = None  # the layers built with checkpointing (_checkpointing)
    recompute_stats: tuple[int, float] | None = None  # the last update's (limit, fraction of packs recomputed)
    host_moments: optim.HostMoments | None = None  # offload_optimizer: where the moments wait between steps

    def __init__(self, layout: Layout, device: torch.device, pad_id: int, max_tokens: int, infer_tokens: int,
                 max_grad_norm: float = 1.0, offload_optimizer: bool = False, offload_model: bool = False) -> None:
        self.layout, self.device, self.pad_id = layout, device, pad_id
        self.max_tokens, self.infer_tokens = max_tokens, infer_tokens
        self.max_grad_norm, self.offload_optimizer, self.offload_model = max_grad_norm, offload_optimizer, offload_model
        self._counts: tuple[int, int] | None = None  # memory_plan.count_parameters, once (_parameter_counts)

    def update_working_bytes(self, tokens: int | None = None) -> int | None:
        """Device bytes per rank this model's next update will take beyond what it holds now: memory_plan's
        working_bytes at its longest micro-batch (the longer of the update's and the no-grad passes'), and the
        AdamW moments until the first optimizer step has allocated them. `tokens`: the step batch's tokens over
        all ranks, which no pack can exceed (None: the configured lengths). Packs that would skip the recompute
        (recompute_above) do so only within the memory free when the update starts (`_recompute_limit`), so
        they add nothing here. None where the plan does not cover it: a model that does not train, a
        vision-language model (the tower's activations), expert, tensor, sequence or context parallelism,
        offloaded weights (actor.offload_model), a CPU. Offloaded moments (offload_optimizer) are planned: none
        stay on the device, a bucket of them visits in the step."""
        if not self._planned():
            return None
        seq = max(self.max_tokens, self.infer_tokens)
        return self._working_bytes(seq if tokens is None else min(seq, tokens), bool(self.cfg.gradient_checkpointing))

    def _working_bytes(self, seq: int, checkpointing: bool) -> int:
        """memory_plan.working_bytes of this model's update at `seq` tokens per micro-batch, as it is now built
        (its head, masters, shards; the moments until the first optimizer step allocates them, the masters' fp32
        gradient sums until the first backward does)."""
        return working_bytes(self.model.config, seq=seq, lora_rank=self.lora.rank, fused_head=not self.keeps_logits,
                             checkpointing=checkpointing, master_weights=self.masters is not None,
                             shards=self.layout.sizes.fsdp, moments=not self.optimizer.state,
                             sums_held=self.masters is not None and self.masters.sums_held,
                             counts=self._parameter_counts(), entropy=self.entropy_in_loss, lm_head=self.lm_head,
                             offload_optimizer=self.offload_optimizer)

    def _parameter_counts(self) -> tuple[int, int]:
        """memory_plan.count_parameters of this model, counted once (a meta-device build: ~65 ms for a 32B
        model, and `_recompute_limit` asks up to 64 lengths per update)."""
        if self._counts is None:
            self._counts = count_parameters(self.model.config, self.lora.rank, value_head=not self.lm_head)
        return self._counts

    def _planned(self) -> bool:
        """Whether memory_plan covers this model's update (update_working_bytes)."""
        sizes, config = self.layout.sizes, self.model.config
        return not (self.device.type != "cuda" or self.optimizer is None or is_vision_config(config)
                    or sizes.ep > 1 or sizes.tp > 1 or sizes.seq > 1 or self.offload_model)

    def use_master_weights(self, dtype: torch.dtype) -> None:
        """The model's weights in `dtype` with fp32 masters for the optimizer (train/models/master_weights.py);
        called before the optimizer is built."""
        self.masters = MasterWeights(self.model, dtype)

    @property
    def trained(self) -> torch.nn.Module:
        """What the optimizer steps and checkpoints hold: the model, or its masters under its names."""
        return self.model if self.masters is None else self.masters.state_module

    @contextmanager
    def full_precision(self) -> Iterator[torch.nn.Module]:
        """The model with its trainable weights at full precision (the fp32 masters in place of their bf16 casts,
        where it has masters): for an export, or to write weights in place (cast into the model after)."""
        if self.masters is None:
            yield self.model
        else:
            with self.masters.in_model() as model:
                yield model

    # -- state: what checkpoints and the governor's snapshots hold ---------------------------------
    def state_parts(self) -> dict[str, object]:
        """Named parts with state_dict()/load_state_dict(): the model (its fp32 masters under its own names where
        it computes in bf16 from them), and when training, the optimizer and scheduler (torchtitan's Stateful
        idea)."""
        parts: dict[str, object] = {"model": self.trained}
        if self.optimizer is not None:
            parts["optimizer"] = self.optimizer
            parts["scheduler"] = self.scheduler
        return parts

    # -- packing ---------------------------------------------------------------------------------
    @property
    def blank(self) -> tuple[int, ImageInputs] | None:
        """A vision-language model's (image token id, blank one-token image) for packs without an image
        (packing.build_packed: every rank's forward runs the tower); None for a text model."""
        config = getattr(self.model, "config", None)
        if config is None or not is_vision_config(config):
            return None
        if not hasattr(self, "_blank"):
            spec, vision = VisionSpec.from_config(config), config.vision_config
            dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
            grid = torch.tensor([1, spec.merge, spec.merge])
            self._blank = (spec.image_token_id, ImageInputs(torch.zeros(spec.merge ** 2, dim), grid, 1, "blank"))
        return self._blank

    def media(self, batch: StepBatch) -> list[SampleMedia] | None:
        """A vision-language batch's per-sample positions and images (built once per batch); None for text."""
        if batch.images is None:
            return None
        if batch.media is None:
            spec = VisionSpec.from_config(self.model.config)
            batch.media = []
            for ids, images in zip(batch.ids, batch.images):
                grids = torch.stack([im.grid for im in images]) if images else None
                batch.media.append(SampleMedia(mrope_positions(ids, grids, spec), tuple(images),
                                               tuple(image_spans(ids, spec.image_token_id))))
        return batch.media

    def packs(self, batch: StepBatch, positions: list[int], max_tokens: int) -> list[PackedMicroBatch]:
        """This dp group's samples `positions` in packs of at most max_tokens per device (x sp)."""
        sp, tp, ring = self.layout.sizes.seq, self.layout.sizes.tp, self.layout.ring
        budget = max_tokens * sp
        multiple = sp * tp * (2 if ring else 1)  # ring: two half chunks per ring rank
        media = self.media(batch)
        if batch.share_prompt and positions:  # each group's common prefix laid out once per pack
            groups = batch.groups.tolist()
            # with images, prefixes are compared with each image's pixels standing in for its placeholders
            keyed = batch.ids if media is None else [keyed_ids(ids, m) for ids, m in zip(batch.ids, media)]
            units = prompt_units(positions, keyed, groups, budget)
            sizes = [unit_length([int(batch.ids[i].numel()) for i in u.members], u.shared) for u in units]
            return [build_packed([i for k in p for i in units[k].members], batch.ids, batch.mask, self.pad_id,
                                 self.device, sp_rank=self.layout.sp_rank, sp_size=sp, multiple=multiple,
                                 units=[units[k] for k in p], routing=batch.routing, ring=ring, media=media,
                                 blank=self.blank)
                    for p in plan_packs(sizes, budget)]
        lengths = [batch.ids[i].numel() for i in positions]
        plan = [[positions[j] for j in p] for p in plan_packs(lengths, budget)] if positions else []
        return [build_packed(p, batch.ids, batch.mask, self.pad_id, self.device, sp_rank=self.layout.sp_rank,
                             sp_size=sp, multiple=multiple, routing=batch.routing, ring=ring, media=media,
                             blank=self.blank) for p in plan]

    def _padding(self) -> PackedMicroBatch:
        sp, tp, ring = self.layout.sizes.seq, self.layout.sizes.tp, self.layout.ring
        return build_packed([], [], [], self.pad_id, self.device, sp_rank=self.layout.sp_rank, sp_size=sp,
                            multiple=sp * tp * (2 if ring else 1), ring=ring, blank=self.blank)

    def _even_out(self, packs_per_part: list[list[PackedMicroBatch]]) -> list[list[PackedMicroBatch]]:
        """Every rank runs as many forwards per part as the busiest (one all-reduce for all parts)."""
        most = all_reduce_max_many([float(len(p)) for p in packs_per_part], self.device)
        return [p + [self._padding() for _ in range(int(n) - len(p))] for p, n in zip(packs_per_part, most)]

    # -- passes ----------------------------------------------------------------------------------
    @torch.no_grad()
    def per_token_pass(self, batch: StepBatch, forward: Callable[[PackedMicroBatch], torch.Tensor],
                       positions: list[int] | None = None) -> list[torch.Tensor]:
        """forward(pack) -> [samples, longest - 1] for every pack of the batch (or of its samples at
        `positions` only); one [len - 1] float32 CPU tensor per sample of the batch, None for those left out.
        Every rank of the layout calls it together (ranks with fewer packs run padding forwards)."""
        self.model.eval()
        chosen = list(range(len(batch))) if positions is None else list(positions)
        [packs] = self._even_out([self.packs(batch, chosen, self.infer_tokens)])
        out: list[torch.Tensor | None] = [None] * len(batch)
        for mb in packs:
            values = forward(mb)[: len(mb.index)].float().cpu()  # one copy to the host per pack, not per sample
            for row, i in enumerate(mb.index):
                out[i] = values[row, : batch.ids[i].numel() - 1]
        return out  # type: ignore[return-value]

    # -- the update loop -------------------------------------------------------------------------
    def run_update(self, batch: StepBatch, epochs: int, mini_batches: int, loss: LossHook,
                   after_backward: Callable[[int, dict[str, float], int], bool] | None = None) -> UpdateStats:
        """`epochs` passes of `mini_batches` optimizer steps. `after_backward(epoch, sums,
        steps_taken)`, given this mini-batch's metric sums (a collective is the hook's to make), may
        return True to drop the step just accumulated and stop (e.g. a target KL)."""
        lead = 1.0 if batch.is_leader else 0.0
        norms, packs = self.prepare(batch, mini_batches)
        stats = UpdateStats()
        self.model.train()
        for epoch in range(epochs):
            for m, part in enumerate(packs):
                local = UpdateStats(maxima=stats.maxima)
                self.accumulate(part, norms[m], loss, local)
                sums = {key: value * lead for key, value in local.sums.items()}
                if after_backward is not None and after_backward(epoch, sums, len(stats.grad_norms)):
                    self.optimizer.zero_grad(set_to_none=True)  # this step is not taken
                    if self.masters is not None:
                        self.masters.discard()
                    return stats
                for key, value in sums.items():
                    stats.add(key, value)
                stats.grad_norms.append(self.optimizer_step())
        return stats

    def prepare(self, batch: StepBatch, mini_batches: int) -> tuple[list[Norms], list[list[PackedMicroBatch]]]:
        """Each mini-batch's global normalisers and this rank's packs (as many as the busiest rank's):
        built once, reused by every epoch."""
        parts = [batch.minibatch_members(m, mini_batches) for m in range(mini_batches)]
        norms = self.mini_batch_norms(batch, mini_batches)
        packs = self._even_out([self.packs(batch, members, self.max_tokens) for members in parts])
        if self.recompute_above is not None:
            self._mark_recompute(packs)
        return norms, packs

    def _mark_recompute(self, packs_per_part: list[list[PackedMicroBatch]]) -> None:
        """Each pack recomputes in the backward when the longest of its place's packs over all ranks is over
        this update's limit (`_recompute_limit`: recompute_above, lowered to what the least free rank has room
        for now); one all-reduce for the update. Ranks choose alike, so collectives inside a recomputed layer
        (expert parallelism's all-to-all, tensor parallelism's reductions) stay matched. A pack's length is what
        one device holds of it: its row over the sequence-parallel ranks (sp x cp) it is split across."""
        flat = [mb for part in packs_per_part for mb in part]
        free = free_device_bytes(self.device) if self.device.type == "cuda" else 0
        split = self.layout.sizes.seq
        *longest, least_free = all_reduce_max_many([float(-(-mb.total_len // split)) for mb in flat] + [-float(free)],
                                                   self.device)
        limit = self._recompute_limit(int(-least_free)) if self.device.type == "cuda" else self.recompute_above
        for mb, tokens in zip(flat, longest):
            mb.recompute = tokens > limit
        self.recompute_stats = (limit, sum(mb.recompute for mb in flat) / max(len(flat), 1))

    def _recompute_limit(self, free_bytes: int) -> int:
        """The longest pack (recompute_above, or a multiple of 1024 below it) whose update without recompute fits
        `free_bytes` now, by memory_plan's working_bytes plus 10% (0: every pack recomputes). recompute_above
        was chosen at build time for an engine asleep through the update; an engine kept awake
        (rollout.sleep=null) leaves less, and then shorter packs skip the recompute, or none."""
        if not self._planned():
            return self.recompute_above
        return longest_fitting([*range(1024, self.recompute_above, 1024), self.recompute_above],
                               lambda s: self._working_bytes(s, False) * HEADROOM <= free_bytes) or 0

    def _checkpointing(self, on: bool) -> None:
        """Turn the model's checkpointed layers' recompute on or off for the next forward (HF's per-layer flag,
        read when the layer is called)."""
        if self._checkpointed is None:
            self._checkpointed = [m for m in self.model.modules()
                                  if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        for layer in self._checkpointed:
            layer.gradient_checkpointing = on

    def accumulate(self, packs: list[PackedMicroBatch], norms: Norms, loss: LossHook, stats: UpdateStats) -> None:
        """Backward over one mini-batch's packs: gradients summed into .grad, no optimizer step; `stats` holds
        the packs' metric sums as floats after it.

        Where each rank holds whole parameters under FSDP (`defers_grad_sync`), gradients are reduced once,
        after the last pack: the backwards before it add into FSDP's unsharded float32 gradients."""
        defer = self.defers_grad_sync and len(packs) > 1
        try:
            for i, mb in enumerate(packs):
                if defer:
                    self.model.set_requires_gradient_sync(i == len(packs) - 1)
                if self.recompute_above is not None:
                    self._checkpointing(mb.recompute)
                (loss(mb, norms, stats) * self.layout.grad_scale).backward()
                if self.masters is not None:  # the bf16 gradients into the fp32 sums
                    self.masters.collect()
            stats.settle()  # the packs' metrics, read in one copy
        finally:
            if defer:
                self.model.set_requires_gradient_sync(True)

    @property
    def defers_grad_sync(self) -> bool:
        """Whether `accumulate` reduces gradients once per mini-batch rather than once per pack: under FSDP
        with an fsdp size of 1 (one GPU in bf16, or replicas over ddp), without offload. There a shard is the
        whole tensor, so the unsharded float32 gradients held between packs take no more memory than the
        reduced ones, and a mini-batch of M packs makes 1 reduction (one all-reduce over ddp), not M, and
        runs FSDP's per-parameter reduce copies once. With fsdp > 1 each rank would hold whole gradients
        instead of its 1/fsdp share, so gradients are reduced after every pack there."""
        return (isinstance(self.model, FSDPModule) and self.layout.sizes.fsdp == 1
                and not self.offload_model)

    def mini_batch_norms(self, batch: StepBatch, mini_batches: int) -> list[Norms]:
        """Each mini-batch's global normalisers (action tokens, sequences): one all-reduce."""
        lead = 1.0 if batch.is_leader else 0.0
        counts = []
        for m in range(mini_batches):
            members = batch.minibatch_members(m, mini_batches)
            counts += [lead * float(sum(float(batch.mask[i].sum()) for i in members)), lead * float(len(members))]
        totals = all_reduce_sum(counts, self.device)
        return [Norms(max(totals[2 * m], 1.0), max(totals[2 * m + 1], 1.0)) for m in range(mini_batches)]

    def local_weight_square(self) -> float:
        """This rank's share of the squared L2 norm of the model's trainable weights (no collective;
        with LoRA, the adapters: the frozen base never moves): each rank reads only its own shards; a
        shard replicated over a mesh dim counts 1/copies. Foreach kernels over the local shards."""
        params = self.masters.masters if self.masters is not None else self.model.parameters()
        pieces, copies = local_pieces([p for p in params if p.requires_grad])
        return float(local_square_sum(pieces, copies, self.device))

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, all) parameters of the full model (global shapes: no collective)."""
        params = list(self.model.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    def weight_norm(self) -> float:
        """The L2 norm of all the model's weights over every rank (one all-reduce of a scalar)."""
        return all_reduce_sum([self.local_weight_square()], self.device)[0] ** 0.5

    def _offloaded_moments(self) -> optim.HostMoments | None:
        """offload_optimizer's host side, made at the first use (offload_model: none, the moments are on the
        host already, beside the parameters the step runs on)."""
        if self.offload_optimizer and not self.offload_model and self.host_moments is None:
            self.host_moments = optim.HostMoments(self.optimizer)
        return self.host_moments

    def optimizer_state_made(self) -> None:
        """Before a checkpoint reads the optimizer's state: offload_optimizer's state, if there is none yet, made on
        the host a bucket at a time (DCP would make all of it on the device at once)."""
        moments = self._offloaded_moments() if self.optimizer is not None else None
        if moments is not None:
            moments.materialize()

    @contextmanager
    def loading_optimizer_state(self) -> Iterator[None]:
        """Around DCP's set_state_dict in a checkpoint's load: offload_optimizer's state, which dcp.load has just
        written in place into the host slabs, stays there (HostMoments.kept_in_place), and whatever the load put
        on the device goes to the host before the next rollout."""
        held = self._offloaded_moments() if self.optimizer is not None else None
        with held.kept_in_place() if held is not None else nullcontext():
            yield
        if held is not None:
            held.offload()

    def optimizer_step(self) -> float:
        """Global gradient clipping and the optimizer step; the pre-clip norm. With masters: on their fp32
        gradient sums, then one cast of the masters into the model."""
        moments = self._offloaded_moments()
        if self.masters is None:
            return optim.clip_and_step(self.model, self.optimizer, self.scheduler, self.max_grad_norm, moments)
        self.masters.attach()
        norm = optim.clip_and_step(self.trained, self.optimizer, self.scheduler, self.max_grad_norm,
                                   moments)  # (it sets the masters' gradients to None)
        self.masters.publish()
        self.masters.restart()
        return norm

    def reduce(self, stats: UpdateStats, prefix: str, sum_keys: tuple[str, ...],
               max_keys: tuple[str, ...] = ()) -> dict[str, float]:
        """Global metrics: token-weighted sums over the global token count (one all-reduce), the
        loss per optimizer step, maxima over ranks (one all-reduce; a `neg_` key holds a minimum),
        grad norms, the learning rate. The key lists are fixed, so every rank reduces the same."""
        totals = dict(zip(sum_keys, all_reduce_sum([stats.sums.get(k, 0.0) for k in sum_keys], self.device)))
        tokens = max(totals.pop("tokens", 0.0), 1.0)
        steps = max(len(stats.grad_norms), 1)
        metrics = {f"{prefix}/loss": totals.pop("loss", 0.0) / steps}
        metrics.update({f"{prefix}/{k}": v / tokens for k, v in totals.items()})
        local_max = [stats.maxima.get(k, float("-inf")) for k in max_keys]
        for k, v in zip(max_keys, all_reduce_max_many(local_max, self.device)):
            if v == float("-inf"):  # no action token on any rank
                continue
            if k.startswith("neg_"):  # a minimum, kept as the max of its negation
                metrics[f"{prefix}/{k[4:]}"] = -v
            else:
                metrics[f"{prefix}/{k}"] = v
        if stats.grad_norms:
            metrics[f"{prefix}/grad_norm"] = sum(stats.grad_norms) / len(stats.grad_norms)
            metrics[f"{prefix}/grad_norm_max"] = max(stats.grad_norms)
        metrics[f"{prefix}/lr"] = self.scheduler.get_last_lr()[0]
        metrics[f"{prefix}/optimizer_steps"] = float(len(stats.grad_norms))
        if self.host_moments is not None:  # offload_optimizer: this rank's moments waiting on the host
            metrics[f"memory/{prefix}_moments_host_gib"] = self.host_moments.host_bytes / 2**30
        return metrics
