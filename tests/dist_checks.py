"""Checks that need a real process group; launched by tests with torchrun (1 or 2 ranks).

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_checks.py grads --out F ...
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.distributed.fsdp import FSDPModule
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train.engines.base import SamplingParams  # noqa: E402
from train.engines.hf import HFEngine  # noqa: E402
from train.models.actor import Actor  # noqa: E402
from train.models.critic import Critic  # noqa: E402
from train.models.trainable import UpdateStats  # noqa: E402
from train.parallel.collectives import all_reduce_sum  # noqa: E402
from train.parallel.distributed import cleanup, init_distributed  # noqa: E402
from train.parallel.step_batch import StepBatch, assign, dispatch, exchange_index  # noqa: E402
from train.parallel.weight_sync import gather_full_tensors  # noqa: E402
from train.parallel.weight_sync import unique_state  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "stub", "model")


def actor_cfg(**overrides):
    cfg = OmegaConf.load(os.path.join(ROOT, "config", "grpo.yaml")).actor
    cfg.model_name = MODEL
    cfg.lr = 1e-3
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v)
    return cfg


@dataclass
class FixedBatch:
    """Ragged samples the same on every rank: token ids, raw action masks (one entry per token),
    one advantage per sequence."""
    ids: list[list[int]]
    action_mask: list[list[int]]
    advantages: list[float]


def fixed_batch(n: int = 10, vocab: int = 300) -> FixedBatch:
    """Ragged sequences with multi-turn style action masks; the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    ids, masks, adv = [], [], []
    for i in range(n):
        length = int(torch.randint(8, 40, (1,), generator=g))
        seq = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompt = int(torch.randint(3, length // 2, (1,), generator=g))
        mask = [0] * prompt + [1] * (length - prompt)
        if i % 3 == 0:  # a tool reply in the middle of the response
            mid = prompt + (length - prompt) // 2
            mask[mid:mid + 3] = [0, 0, 0]
        ids.append(seq)
        masks.append(mask)
        adv.append(float(torch.randn(1, generator=g)))
    return FixedBatch(ids, masks, adv)


def grouped_batch(n: int = 10, vocab: int = 300, group: int = 4) -> FixedBatch:
    """Like fixed_batch, but the samples come in groups of `group` that share a prompt (as a GRPO
    group does); in group 0 two responses also share their first tokens (a shared prefix that holds
    action tokens) and one sample is an exact copy of another."""
    g = torch.Generator().manual_seed(4321)
    ids, masks, adv = [], [], []
    for i in range(n):
        if i % group == 0:
            prompt = torch.randint(3, vocab, (int(torch.randint(6, 16, (1,), generator=g)),), generator=g).tolist()
        reply = torch.randint(3, vocab, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        if i == 1:
            reply = ids[0][len(prompt):len(prompt) + 2] + reply
        if i == 2:
            reply = ids[0][len(prompt):]
        mask = [0] * len(prompt) + [1] * len(reply)
        if i % 3 == 1 and len(reply) > 8:  # a tool reply in the middle of the response
            mask[len(prompt) + 4:len(prompt) + 6] = [0, 0]
        ids.append(prompt + reply)
        masks.append(mask)
        adv.append(float(torch.randn(1, generator=g)))
    return FixedBatch(ids, masks, adv)


def step_batch(worker, batch: FixedBatch, own: list[int], ctx, share: bool = False,
               group: int = 0, routes: dict | None = None) -> tuple[StepBatch, list[int]]:
    """The StepBatch this rank's dp group holds when this rank rolled out samples `own` of `batch`
    (the trainer's path: exchange the index, dispatch once), and the fixed-batch number of each of
    its samples. `group` > 0: samples i // group form the groups (numbered per rank, as the trainer
    does); `share`: dispatched with actor.share_prompt; `routes`: dispatch's routing keywords
    (train/models/router_replay.py's dispatch_routes of the `own` samples)."""
    ids = [batch.ids[i] for i in own]
    masks = [batch.action_mask[i] for i in own]
    if group:
        firsts = sorted({i // group for i in own})
        groups = [firsts.index(i // group) for i in own]
    else:
        groups = list(range(len(ids)))
    index = exchange_index([len(x) for x in ids], groups, [0.0] * len(ids), ctx.device)
    sb = dispatch(index, ids, masks, [[0.0] * len(x) for x in ids], worker.layout, 1, ctx.device, share_prompt=share,
                  **(routes or {}))
    owners = {}
    for r in range(ctx.world_size):
        for j, i in enumerate(OWN[r]):
            owners[(r, j)] = i
    return sb, [owners[(index.owner[g], index.local[g])] for g in sb.members]


def per_token(values: list[float], sb: StepBatch, source: list[int]) -> list[torch.Tensor]:
    """A per-sequence value on each action token of the batch's samples."""
    return [values[i] * m for i, m in zip(source, sb.mask)]


UNEVEN = {1: [0], 2: [0, 7], 4: [0, 3, 5, 9]}  # where each rank's own samples start


OWN: dict[int, list[int]] = {}  # rank -> the samples it rolled out (set by set_ownership)


def own_samples(n: int, split: str, rank: int, world: int) -> list[int]:
    """The samples a rank rolled out itself: an uneven split, or all on rank 0 (e.g. every group of
    the other ranks was filtered)."""
    if split == "all_on_rank0":
        return list(range(n)) if rank == 0 else []
    starts = UNEVEN[world] + [n]
    return list(range(starts[rank], starts[rank + 1]))


def set_ownership(n: int, split: str, world: int) -> None:
    for r in range(world):
        OWN[r] = own_samples(n, split, r, world)


def layout_overrides(args) -> dict:
    return {"ddp_size": args.ddp, "tp_size": args.tp, "sp_size": args.sp, "ep_size": args.ep, "cp_size": args.cp,
            "offload_model": args.offload, "offload_optimizer": args.offload, "gradient_checkpointing": args.ac,
            "compile": args.compile, "master_weights": {"null": None, "true": True, "false": False}[args.masters],
            **({"use_liger_kernel": True} if args.fused_head else {})}  # (an actor's key)


def grads(args, ctx) -> None:
    torch.manual_seed(0)
    cfg = actor_cfg(agg_mode=args.agg, max_length_per_device=args.max_tokens, max_grad_norm=args.clip,
                    loss=args.loss, dtype=args.dtype, **{"entropy.coef": args.entropy}, **layout_overrides(args),
                    **lora_overrides(args))
    if args.reduce_every_pack:  # the accumulation as it was before gradients were reduced once per mini-batch
        Actor.defers_grad_sync = property(lambda self: False)
    actor = Actor(cfg, ctx, args.model, pad_token_id=0, train=True, temperature=1.0, total_updates=1)
    if args.lora:
        with actor.full_precision() as model:  # (the fp32 masters, where the actor has them)
            perturb_adapters(model)
    batch = grouped_batch() if args.grouped else fixed_batch()
    set_ownership(len(batch.ids), args.split, ctx.world_size)
    sb, source = step_batch(actor, batch, OWN[ctx.rank], ctx, args.share, 4 if args.grouped else 0)
    sb.fields["advantages"] = per_token(batch.advantages, sb, source)
    actor.recompute_above = args.recompute_above  # what the plan chooses on a GPU (memory_plan.recompute_above)
    recomputes = count_recomputes(actor.model)
    norms, [packs] = actor.prepare(sb, 1)
    shared_packs(packs, args)
    actor.model.train()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        actor.accumulate(packs, norms[0], actor.policy_loss(sb, 32), UpdateStats())  # gradients, no step
    # FSDP's gradient reductions (one per FSDP unit and backward that reduces), and the packs they came from
    reduces = sum(e.name.startswith("FSDP::post_backward_reduce") for e in prof.events())
    torch.save({"lengths": [mb.total_len for mb in packs], "recompute": [mb.recompute for mb in packs],
                "recomputed_layers": recomputes[0], "layers": recomputes[1]}, f"{args.out}.rank{ctx.rank}.packs")
    step_and_save(actor, ctx, args.out, packs=len(packs), reduces=reduces, defers=actor.defers_grad_sync)


def offload_moments(args, ctx) -> None:
    """Three updates with actor.offload_optimizer against the same without, plain fp32 (FSDP2: DTensor moments) and
    bf16 with fp32 masters (plain moments): the weights after each update, and between updates where the moments
    are (their pieces' devices and storages) and what the host slab holds."""
    from train.models import optim
    from train.parallel.shard_norms import local_tensor
    from train.runtime.checkpoint import Checkpointer

    optim.MOMENT_BUCKET_BYTES = args.bucket_kb * 1024  # several buckets even for the stub
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    out: dict = {}

    def build(masters: bool, offload: bool):
        torch.manual_seed(0)
        cfg = actor_cfg(max_length_per_device=args.max_tokens, offload_optimizer=offload,
                        dtype="bfloat16" if masters else "float32", master_weights=masters, update_per_rollout=1)
        actor = Actor(cfg, ctx, args.model, pad_token_id=0, train=True, temperature=1.0, total_updates=3)
        batch = fixed_batch()
        set_ownership(len(batch.ids), args.split, ctx.world_size)
        sb, source = step_batch(actor, batch, OWN[ctx.rank], ctx)
        sb.fields["advantages"] = per_token(batch.advantages, sb, source)
        # the moments outside the host slabs at each AdamW call (during an offloaded step: one bucket's)
        real_step, actor.on_device = actor.optimizer.step, []

        def step(*a, **k):
            done = real_step(*a, **k)
            if actor.host_moments is not None:
                actor.on_device.append(actor.host_moments.device_bytes())
            return done

        actor.optimizer.step = step
        return actor, sb

    def weights_of(actor) -> dict:
        with actor.full_precision() as model:
            return {name: full(p).detach().clone() for name, p in model.named_parameters()}

    for masters in (False, True) if ctx.world_size == 1 else (False,):  # (masters: one process only)
        checkpoints = Checkpointer(f"{args.out}.ckpt{int(masters)}", ctx)
        for offload in (False, True):
            actor, sb = build(masters, offload)
            steps = []
            for step in range(3):
                metrics = actor.update(sb, 32)
                weights = weights_of(actor)
                if offload and step == 1:  # a checkpoint while the moments wait in the slab
                    saved = checkpoints.save(2, {"actor": actor}, {"step": 2}, {})
                held = actor.host_moments
                pieces = held.pieces() if held is not None else []
                steps.append({"weights": weights, "devices": sorted({p.device.type for p in pieces}),
                              "storages": len({p.untyped_storage().data_ptr() for p in pieces}),
                              "storage": tuple(sorted({p.untyped_storage().data_ptr() for p in pieces})),
                              "pieces": len(pieces), "host_bytes": held.host_bytes if held is not None else 0,
                              "piece_bytes": sum(p.numel() * p.element_size() for p in pieces),
                              "trainable": sum(p.numel() for p in actor.trained.parameters() if p.requires_grad),
                              "masters": actor.masters is not None,
                              "buckets": len(held.buckets) if held is not None else 0,
                              "largest": max(2 * local_tensor(p).numel() * p.element_size()
                                             for p in actor.trained.parameters() if p.requires_grad),
                              "on_device": list(actor.on_device), "limit": optim.MOMENT_BUCKET_BYTES,
                              "metric": metrics.get("memory/actor_moments_host_gib")})
                actor.on_device.clear()
            out[(masters, offload)] = steps
        # resumed from that checkpoint into a new actor with its moments offloaded, the third update again
        actor, sb = build(masters, True)
        cast, casts = torch.optim.Optimizer._process_value_according_to_param_policy, []

        def counted(*a, **k):  # what torch's load_state_dict sends to the parameters' device
            casts.append(k.get("key", a[4] if len(a) > 4 else None))
            return cast(*a, **k)

        torch.optim.Optimizer._process_value_according_to_param_policy = staticmethod(counted)
        try:
            checkpoints.load(saved, {"actor": actor})  # (its state made first on the host, a bucket at a time)
        finally:
            torch.optim.Optimizer._process_value_according_to_param_policy = staticmethod(cast)
        out[(masters, "load_casts")] = len(casts)
        out[(masters, "load_on_device")] = list(actor.on_device)
        out[(masters, "loaded_devices")] = sorted({p.device.type for p in actor.host_moments.pieces()})
        out[(masters, "loaded_storages")] = len({p.untyped_storage().data_ptr() for p in actor.host_moments.pieces()})
        actor.on_device.clear()
        actor.update(sb, 32)
        out[(masters, "resumed")] = weights_of(actor)
    if ctx.is_main:
        torch.save(out, args.out)


def count_recomputes(model) -> list[int]:
    """[layer forwards that went through activation checkpointing, checkpointed layers]: each checkpointed
    layer's checkpoint function counts its calls (HF calls it only when the layer's flag is on)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    counts = [0, 0]
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing:
            counts[1] += 1
            inner = layer._gradient_checkpointing_func

            def counted(*a, inner=inner, **k):
                counts[0] += 1
                return inner(*a, **k)

            layer._gradient_checkpointing_func = counted
    return counts


def shared_packs(packs, args) -> None:
    """With --share, the packs really lay prompts out once (else the check would prove nothing)."""
    if args.share:
        assert sum(mb.laid_out for mb in packs) < sum(mb.represented for mb in packs), "nothing was shared"


def step_and_save(worker, ctx, out, **extra) -> None:
    """Full gradients of the trainable parameters, the optimizer step's (clipped) norm, the updated
    full weights (frozen ones too) and the names the optimizer keeps state for, and `extra`, to `out` on rank 0."""
    if worker.masters is not None:  # the fp32 masters' gradient sums, as the optimizer step sees them
        worker.masters.attach()
    params = worker.trained.named_parameters  # the model, or its fp32 masters under its names
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731 - one process: plain tensors
    grads = {name: full(p.grad).clone() for name, p in params() if p.requires_grad}
    frozen_grads = [name for name, p in params() if not p.requires_grad and p.grad is not None]
    group = worker.optimizer.param_groups[0]
    adam = {"lr": float(group["lr"]), "eps": float(group["eps"]), "max_norm": float(worker.max_grad_norm)}
    norm = worker.optimizer_step()
    with worker.full_precision() as model:  # the fp32 masters in place, where the model computes from bf16 casts
        weights = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    optimized = [name for name, p in params() if p in worker.optimizer.state]
    # actor.compile: the modules running compiled, and the graphs dynamo built for them (all layers together)
    compiled = sum(getattr(m, "_compiled_call_impl", None) is not None for m in worker.model.modules())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if ctx.is_main:
        torch.save({"grads": grads, "norm": norm, "weights": weights, "optimized": optimized,
                    "frozen_grads": frozen_grads, "adam": adam, "compiled_modules": compiled, "graphs": graphs,
                    "masters": worker.masters is not None,
                    "fused_head": getattr(worker, "fused_head", None) is not None, **extra}, out)


def placed_like(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The full tensor `w` (the same on every rank) laid out as parameter `p`: this rank's piece under FSDP/TP."""
    if hasattr(p, "device_mesh"):
        return torch.distributed.tensor.distribute_tensor(w, p.device_mesh, p.placements, src_data_rank=None)
    return w


@torch.no_grad()
def perturb_adapters(model, seed: int = 11) -> None:
    """LoRA's B starts at 0, which gives A no gradient: set every B to small seeded values (the same
    full tensor on every rank, each rank keeping its piece) so every adapter matrix learns."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            p.copy_(placed_like(p, torch.randn(p.shape, generator=g) * 0.05))


@torch.no_grad()
def perturb_all(model, scale: float = 0.02) -> None:
    """Seeded noise on every weight, the same full tensor for a name whatever the layout (each rank adds its
    piece): a plain model perturbed the same way is the reference."""
    import zlib

    for name, p in model.named_parameters():
        w = torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * scale
        p.add_(placed_like(p, w.to(p.dtype)))


def drift(args, ctx) -> None:
    """kl_to_start/test (train/trainer/drift.py) on this layout: a perturbed actor against its starting model (the
    KL reference, or with --lora the base under perturbed adapters), each rank holding its own samples; rank 0
    saves it with a float64 reference from plain transformers models (perturbed the same way)."""
    from transformers import AutoModelForCausalLM

    from train.models.actor import AdapterFreeReference
    from train.models.lora import merged_state
    from train.trainer.drift import StartDrift
    from train.workers.rollout import Sample

    torch.manual_seed(0)
    cfg = actor_cfg(max_length_per_device=args.max_tokens, **layout_overrides(args), **lora_overrides(args))
    actor = Actor(cfg, ctx, MODEL, pad_token_id=0, train=True, temperature=0.7, total_updates=1)
    if args.lora:
        perturb_adapters(actor.model)
        start = AdapterFreeReference(actor)
    else:
        perturb_all(actor.model)
        start = Actor(cfg, ctx, MODEL, pad_token_id=0, train=False, temperature=0.7)
    batch = fixed_batch()
    sources = ["a", "b"]
    mine = [Sample(group=0, messages=[], answer=None, ids=ids, action_mask=mask, sampler_logprobs=[0.0] * len(ids),
                   source=sources[i % 3 == 0]) for i, (ids, mask) in enumerate(zip(batch.ids, batch.action_mask))
            if i % ctx.world_size == ctx.rank]
    got = StartDrift(actor, start, ctx, vision=False)(mine, sources)
    # the adapted policy as plain weights: the export's merge, W + scaling * B A (collective: every rank)
    merged = {name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in merged_state(actor.model)}
    if not ctx.is_main:
        return
    policy = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float64)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float64)
    if args.lora:
        missing, unexpected = policy.load_state_dict({k: v.double() for k, v in merged.items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # (tied: given once)
    else:
        perturb_all(policy, 0.02)
    sums: dict[str, list[float]] = {}
    for i, (ids, mask) in enumerate(zip(batch.ids, batch.action_mask)):
        x = torch.tensor([ids])
        with torch.no_grad():
            lp = [torch.log_softmax(m(input_ids=x).logits[0, :-1] / 0.7, -1).gather(-1, x[0, 1:, None])[:, 0]
                  for m in (policy, base)]
        m = torch.tensor(mask[1:], dtype=torch.float64)
        acc = sums.setdefault(sources[i % 3 == 0], [0.0, 0.0])
        acc[0] += float(((lp[0] - lp[1]) * m).sum())
        acc[1] += float(m.sum())
    expected = {"kl_to_start/test": sum(v[0] for v in sums.values()) / sum(v[1] for v in sums.values()),
                **{f"kl_to_start/test/{k}": v[0] / v[1] for k, v in sums.items()}}
    torch.save({"got": got, "expected": expected}, args.out)


def lora_overrides(args) -> dict:
    return {"lora.rank": args.lora, "lora.alpha": 2.0 * args.lora} if args.lora else {}


def packing(args, ctx) -> None:
    """Packed actor vs a plain per-sequence reference (see tests/integration/test_packing.py)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = actor_cfg(max_length_per_device=48, model_name=args.model)
    actor = Actor(cfg, ctx, args.model, pad_token_id=0, train=True, temperature=0.7, total_updates=1)
    batch = grouped_batch() if args.grouped else fixed_batch()
    n = len(batch.ids)
    set_ownership(n, "uneven", ctx.world_size)
    sb, source = step_batch(actor, batch, list(range(n)), ctx, share=args.share, group=4 if args.grouped else 0)
    assert source == list(range(n))
    packs = len(actor.packs(sb, list(range(n)), 48))
    logp = actor.compute_logprobs(sb)
    sb.fields["advantages"] = per_token(batch.advantages, sb, source)
    norms, [mbs] = actor.prepare(sb, 1)
    actor.model.train()
    actor.accumulate(mbs, norms[0], actor.policy_loss(sb, 32), UpdateStats())
    got = {name: p.grad.clone() for name, p in actor.model.named_parameters()}
    plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    n_tok = sum(sum(m[1:]) for m in batch.action_mask)
    loss, err = 0.0, 0.0
    for seq, mask, adv, lp in zip(batch.ids, batch.action_mask, batch.advantages, logp):
        logits = plain(input_ids=torch.tensor([seq])).logits[0, :-1].double() / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
        m = torch.tensor(mask[1:], dtype=torch.float64)
        err = max(err, float(((ref.detach() - lp.double()) * m).abs().max()))
        loss = loss - adv * (ref * m).sum() / n_tok  # the PPO loss's gradient at ratio 1
    loss.backward()
    grads = {name: (got[name], p.grad.float()) for name, p in plain.named_parameters()}
    torch.save({"packs": packs, "logp_err": err, "grads": grads}, args.out)


def critic_cfg(**overrides):
    cfg = OmegaConf.load(os.path.join(ROOT, "config", "grpo.yaml")).critic
    cfg.lr = 1e-3
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def critic_grads(args, ctx) -> None:
    """The critic follows the actor's rule: global token normaliser x world size (1 vs 2 ranks)."""
    torch.manual_seed(0)
    critic = Critic(critic_cfg(max_length_per_device=args.max_tokens, max_grad_norm=args.clip, clip=0.2,
                               dtype=args.dtype, **layout_overrides(args), **lora_overrides(args)), ctx, args.model,
                    pad_token_id=0, total_updates=1)
    with critic.full_precision() as model, torch.no_grad():  # (the fp32 masters, where the critic has them)
        if args.lora:
            perturb_adapters(model)
        g = torch.Generator().manual_seed(7)  # a non-zero head, so the backbone gets gradients too
        weight = model.value_head.weight
        weight.copy_(placed_like(weight, torch.randn(weight.shape, generator=g) * 0.1))
    batch = grouped_batch() if args.grouped else fixed_batch()
    g = torch.Generator().manual_seed(99)
    returns = [torch.randn(len(s) - 1, generator=g) for s in batch.ids]
    old = [torch.randn(len(s) - 1, generator=g) * 0.1 for s in batch.ids]
    set_ownership(len(batch.ids), args.split, ctx.world_size)
    sb, source = step_batch(critic, batch, OWN[ctx.rank], ctx, args.share, 4 if args.grouped else 0)
    sb.fields["returns"] = [returns[i] for i in source]
    sb.fields["values"] = [old[i] for i in source]
    norms, [packs] = critic.prepare(sb, 1)
    shared_packs(packs, args)
    critic.model.train()
    critic.accumulate(packs, norms[0], critic.value_loss(sb), UpdateStats())
    step_and_save(critic, ctx, args.out)


def reference(args, ctx) -> None:
    """The reference actor shares no storage with the policy and does not move when the policy trains."""
    torch.manual_seed(0)
    cfg = actor_cfg(**{"kl.coef": 0.5, "kl.type": "low_var_kl"})
    actor = Actor(cfg, ctx, MODEL, pad_token_id=0, train=True, temperature=1.0, total_updates=4)
    ref = Actor(cfg, ctx, MODEL, pad_token_id=0, train=False, temperature=1.0)
    full = lambda m: {k: v.clone() for k, v in gather_full_tensors(m.state_dict().items(), 1 << 20)}  # noqa: E731
    before = full(ref.model)
    ptrs = lambda m: {t.to_local().untyped_storage().data_ptr() for t in m.state_dict().values()}  # noqa: E731
    shared = ptrs(actor.model) & ptrs(ref.model)
    batch = fixed_batch()
    set_ownership(len(batch.ids), "uneven", ctx.world_size)
    sb, source = step_batch(actor, batch, OWN[ctx.rank], ctx)
    sb.fields["ref_logp"] = ref.compute_logprobs(sb)
    sb.fields["advantages"] = per_token(batch.advantages, sb, source)
    kls = []
    for _ in range(3):
        kls.append(actor.update(sb, 32)["actor/kl"])
    after = full(ref.model)
    moved = max(float((after[k] - v).abs().max()) for k, v in before.items())
    policy_moved = max(float((full(actor.model)[k] - v).abs().max()) for k, v in before.items())
    if ctx.is_main:
        torch.save({"shared": len(shared), "ref_moved": moved, "policy_moved": policy_moved, "kls": kls,
                    "ref_requires_grad": any(p.requires_grad for p in ref.model.parameters())}, args.out)


def bf16_passes(args, ctx) -> None:
    """bf16 log-probs three ways on the same batch: a frozen model (a KL reference: its weights held in bf16), an
    actor under FSDP2's mixed precision (fp32 weights cast at each forward) and, on one process, an actor with
    fp32 masters (bf16 weights). Also how each holds its weights: module type, dtypes and bytes on this rank."""
    torch.manual_seed(0)
    cfg = actor_cfg(dtype="bfloat16", max_length_per_device=args.max_tokens, **{"kl.coef": 0.1})
    kinds = {"frozen": (False, None), "fsdp": (True, False)}
    if ctx.world_size == 1:
        kinds["masters"] = (True, True)
    batch = fixed_batch()
    set_ownership(len(batch.ids), args.split, ctx.world_size)
    out = {}
    for kind, (train, masters) in kinds.items():
        OmegaConf.update(cfg, "master_weights", masters)
        model = Actor(cfg, ctx, MODEL, pad_token_id=0, train=train, temperature=1.0)
        sb, source = step_batch(model, batch, OWN[ctx.rank], ctx)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.model.parameters()]
        out[kind] = {"logprobs": dict(zip(source, model.compute_logprobs(sb))),
                     "fsdp": isinstance(model.model, FSDPModule), "masters": model.masters is not None,
                     "dtypes": sorted({str(p.dtype) for p in local}),
                     "bytes": sum(p.numel() * p.element_size() for p in local)}
    torch.save(out, args.out.replace(".pt", f".rank{ctx.rank}.pt"))


def teachers(args, ctx) -> None:
    """distill.teachers: two teachers in the reference slot (the second with moved weights), each scoring only the
    samples routed to it, one sample routed to the second (so one dp group has none of its samples and runs a
    padding forward), some to none. Each routed sample's log-probs against that teacher scoring the whole batch."""
    from torch.distributed.tensor import DTensor

    from train.trainer.teachers import RoutedTeachers

    torch.manual_seed(0)
    cfg = actor_cfg(**layout_overrides(args))
    first, second = (Actor(cfg, ctx, MODEL, pad_token_id=0, train=False, temperature=1.0) for _ in range(2))
    with torch.no_grad():  # the same shift on every rank's shard: a different model, the same on all ranks
        for p in second.model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.add_(0.05 * torch.sin(torch.arange(local.numel(), dtype=local.dtype)).view_as(local))
    batch = fixed_batch()
    set_ownership(len(batch.ids), args.split, ctx.world_size)
    route = [1 if i == 9 else -1 if i % 3 == 0 else 0 for i in range(len(batch.ids))]
    own = OWN[ctx.rank]
    index = exchange_index([len(batch.ids[i]) for i in own], list(range(len(own))), [0.0] * len(own), ctx.device,
                           routes=[route[i] for i in own])
    sb = dispatch(index, [batch.ids[i] for i in own], [batch.action_mask[i] for i in own],
                  [[0.0] * len(batch.ids[i]) for i in own], first.layout, 1, ctx.device)
    routed = RoutedTeachers([first, second]).compute_logprobs(sb)
    whole = [first.compute_logprobs(sb), second.compute_logprobs(sb)]
    diff, untaught, held = 0.0, 0.0, [0.0, 0.0, 0.0]
    for i, g in enumerate(sb.members):
        k = index.route[g]
        held[k + 1] += 1.0
        if k < 0:
            untaught = max(untaught, float(routed[i].abs().max()))
        else:
            diff = max(diff, float((routed[i] - whole[k][i]).abs().max()))
    apart = max(float((a - b).abs().max()) for a, b in zip(*whole))
    stats = torch.tensor([diff, untaught, apart])
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX)
    counts = torch.tensor(held)
    torch.distributed.all_reduce(counts)
    if ctx.is_main:
        torch.save({"diff": float(stats[0]), "untaught": float(stats[1]), "teachers_apart": float(stats[2]),
                    "per_route": counts.tolist(), "my_second": held[2]}, args.out)


def lora_reference(args, ctx) -> None:
    """A LoRA actor's KL reference (its adapters off) against a separately built plain actor of the
    base model: the same log-probs; the adapted policy's differ. Then a real update and a push of the
    adapters alone: the engine (LoRA layers of its own) scores like the trainer."""
    from train.models.actor import AdapterFreeReference
    from train.models.lora import LoraSettings
    from train.trainer.policy_sync import PolicySync
    from train.trainer.sync_check import actor_logprobs

    class Log:
        def event(self, *a, **k): ...
        def write(self, *a, **k): ...

    torch.manual_seed(0)
    cfg = actor_cfg(**layout_overrides(args), **{"lora.rank": 4, "lora.alpha": 8.0, "kl.coef": 0.1})
    actor = Actor(cfg, ctx, MODEL, pad_token_id=0, train=True, temperature=0.7, total_updates=2)
    perturb_adapters(actor.model)
    plain = Actor(cfg, ctx, MODEL, pad_token_id=0, train=False, temperature=0.7)
    batch = fixed_batch()
    set_ownership(len(batch.ids), "uneven", ctx.world_size)
    sb, source = step_batch(actor, batch, OWN[ctx.rank], ctx)
    ref = AdapterFreeReference(actor).compute_logprobs(sb)
    base = plain.compute_logprobs(sb)
    policy = actor.compute_logprobs(sb)
    masks = [sb.mask[i].bool() for i in range(len(sb))]
    ref_diff = max(float((r - b)[m].abs().max()) for r, b, m in zip(ref, base, masks))
    policy_diff = max(float((p - b)[m].abs().max()) for p, b, m in zip(policy, base, masks))
    sb.fields["ref_logp"] = ref
    sb.fields["advantages"] = per_token(batch.advantages, sb, source)
    metrics = actor.update(sb, 32)
    engine = HFEngine.from_pretrained(MODEL, device=ctx.device, seed=0, lora=LoraSettings(4, 8.0))
    names = list(engine.model.state_dict())
    sync = PolicySync(actor.model, engine, 1.0, None, {"actor": actor}, Log(), verify=True, device=ctx.device,
                      rank=ctx.rank)
    pushed = []
    record = engine.update_weights

    def recording(named):
        return record((pushed.append(n) or (n, t)) for n, t in named)

    engine.update_weights = recording
    sync.push(step=1)
    probe = [1, 50, 60, 70, 80, 90, 100, 7, 8, 9]
    probe_diff = float((engine.score(probe, 0.7) - actor_logprobs(actor, probe, ctx.device)).abs().max())
    if ctx.is_main:
        torch.save({"ref_diff": ref_diff, "policy_diff": policy_diff, "kl": metrics["actor/kl"], "pushed": pushed,
                    "engine_names": names, "probe_diff": probe_diff}, args.out)


def rss_mib() -> float:
    """This process's resident memory (VmRSS: private and file-backed pages, e.g. a memory-mapped
    checkpoint that from_pretrained reads without copying), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def shared_base(args, ctx) -> None:
    """rollout.share_actor_base: an engine over the LoRA actor's own base tensors (train/models/shared_base.py)
    against an engine that loads its own copy: the tensors it borrows are the actor's (data pointers),
    building it costs no model's worth of memory, a push moves the adapters alone, both engines generate
    the same tokens and log-probs, sleep leaves the borrowed tensors in place, an update leaves the base
    alone, and a push of other values into a borrowed tensor is refused (of the tensor itself, skipped)."""
    from train.models.lora import LoraSettings, adapter_state, is_adapter
    from train.models.shared_base import engine_model_over
    from train.trainer.policy_sync import PolicySync

    class Log:
        def event(self, *a, **k): ...
        def write(self, *a, **k): ...

    torch.manual_seed(0)
    settings = LoraSettings(4, 8.0)
    cfg = actor_cfg(model_name=args.model, dtype=args.dtype, master_weights=layout_overrides(args)["master_weights"],
                    **{"lora.rank": 4, "lora.alpha": 8.0})
    actor = Actor(cfg, ctx, args.model, pad_token_id=0, train=True, temperature=1.0, total_updates=2)
    with actor.full_precision() as m:  # (the fp32 masters, where the actor has them)
        perturb_adapters(m)
    local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in actor.model.state_dict().items()}
    prompts = [[1, 50 + i, 60, 70 + 3 * i] for i in range(6)]

    async def gen(engine):
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=12, temperature=1.0, seed=i))
                                      for i, p in enumerate(prompts)))

    # Each engine built and run once (every weight page touched); the one with its own copy first, so
    # one-time costs land on it, not on the shared one.
    before = rss_mib()
    own = HFEngine.from_pretrained(args.model, device=ctx.device, dtype=args.dtype, seed=0, lora=settings,
                                   eos_token_ids=[2])
    asyncio.run(gen(own))
    grown_own = rss_mib() - before
    before = rss_mib()
    model, borrowed = engine_model_over(actor.model, settings)
    shared = HFEngine(model, eos_token_ids=[2], device=ctx.device, seed=0, copy_model=False, borrowed=borrowed)
    asyncio.run(gen(shared))
    grown_shared = rss_mib() - before
    engine_state = shared.model.state_dict()
    same_storage = all(engine_state[n].data_ptr() == local[n].data_ptr() for n in borrowed)
    pushed: list[tuple[str, int]] = []
    record = shared.update_weights

    def recording(named):
        return record((pushed.append((n, t.numel() * t.element_size())) or (n, t)) for n, t in named)

    shared.update_weights = recording
    for engine in (shared, own):
        PolicySync(actor.model, engine, 1.0, None, {"actor": actor}, Log(), verify=True, device=ctx.device,
                   rank=ctx.rank).push(step=1)
    got, want = asyncio.run(gen(shared)), asyncio.run(gen(own))
    shared.sleep()
    kept_on_sleep = all(shared.model.state_dict()[n].data_ptr() == local[n].data_ptr() for n in borrowed)
    shared.wake()
    base_before = {n: local[n].clone() for n in borrowed}
    batch = fixed_batch()
    set_ownership(len(batch.ids), "uneven", ctx.world_size)
    sb, source = step_batch(actor, batch, OWN[ctx.rank], ctx)
    sb.fields["advantages"] = per_token(batch.advantages, sb, source)
    actor.update(sb, 32)
    base_unchanged = all(torch.equal(base_before[n], local[n]) for n in borrowed)
    record({borrowed[0]: local[borrowed[0]]})  # the tensor itself: nothing to write (a full fine-tune's push)
    try:
        record({borrowed[0]: local[borrowed[0]].clone()})  # other values: the engine's own method refuses them
        refused = ""
    except ValueError as e:
        refused = str(e)
    if ctx.is_main:
        torch.save({"borrowed": borrowed, "base_names": [n for n in local if not is_adapter(n)],
                    "adapter_names": [n for n, _ in adapter_state(actor.model)], "same_storage": same_storage,
                    "grown_shared_mib": grown_shared, "grown_own_mib": grown_own,
                    "model_mib": sum(t.numel() * t.element_size() for n, t in local.items() if not is_adapter(n)) / 2**20,
                    "pushed": pushed, "tokens": ([g.token_ids for g in got], [w.token_ids for w in want]),
                    "logprobs": ([g.logprobs for g in got], [w.logprobs for w in want]),
                    "kept_on_sleep": kept_on_sleep, "base_unchanged": base_unchanged, "refused": refused,
                    "engine_dtype": str(shared.dtype)}, args.out)


def match(args, ctx) -> None:
    """Sampler (hf engine) log-probs vs the trainer's recomputation, and the weight push."""
    torch.manual_seed(0)
    cfg = actor_cfg()
    actor = Actor(cfg, ctx, MODEL, pad_token_id=0, train=True, temperature=0.7, total_updates=1)
    engine = HFEngine.from_pretrained(MODEL, device=ctx.device, seed=0)
    prompts = [[1, 50 + i, 60, 70 + 3 * i] for i in range(6)]

    async def gen():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=20, temperature=0.7, seed=i))
                                      for i, p in enumerate(prompts)))

    gens = asyncio.run(gen())
    batch = FixedBatch([p + g.token_ids for p, g in zip(prompts, gens)],
                       [[0] * len(p) + [1] * len(g.token_ids) for p, g in zip(prompts, gens)], [1.0, -1.0] * 3)
    set_ownership(len(prompts), "all_on_rank0", ctx.world_size)
    sb, source = step_batch(actor, batch, OWN[ctx.rank], ctx)
    trainer = actor.compute_logprobs(sb)
    diffs = [float((t[len(prompts[i]) - 1:] - torch.tensor(gens[i].logprobs)).abs().max())
             for t, i in zip(trainer, source)]
    # One real update, then the push: the engine must hold exactly the actor's new weights.
    sb.fields["advantages"] = per_token(batch.advantages, sb, source)
    actor.update(sb, 20)
    engine.update_weights(gather_full_tensors(unique_state(actor.model), 1 << 20, engine.dtype))
    engine_sd = engine.model.state_dict()
    push_diff = max(float((v - engine_sd[k]).abs().max())
                    for k, v in gather_full_tensors(actor.model.state_dict().items(), 1 << 20))
    changed = asyncio.run(gen())
    if ctx.is_main:
        torch.save({"max_logprob_diff": max(diffs), "push_diff": push_diff,
                    "changed": any(a.token_ids != b.token_ids for a, b in zip(gens, changed))}, args.out)


def router_replay(args, ctx) -> None:
    """A mixture of experts whose routers the sampler and the trainer break differently: the trainer's model
    ties experts 0 and 1 exactly, the engine's copy moves expert 1's gate row by 1e-6, so tokens in contention
    for the last top-k slot go to another expert. The trainer's own path (dispatch with the routes, packing,
    the actor's forward) with and without the sampler's routes replayed, against the engine's log-probs."""
    from train.models.router_replay import dispatch_routes, moe_routers

    cfg = actor_cfg(model_name=args.model, router_replay="all", **layout_overrides(args))
    actor = Actor(cfg, ctx, args.model, pad_token_id=0, train=True, temperature=1.0, total_updates=1)
    engine = HFEngine.from_pretrained(args.model, device=ctx.device, seed=0, record_routing=True)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_routers(engine.model):
            router.weight[1] += 1e-6 * torch.randn(router.weight.shape[1], generator=g)
    prompts = [[1, 50 + i // 4, 60, 70 + 3 * (i // 4)] for i in range(12)]  # groups of 4 share a prompt

    async def gen():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=16, seed=i))
                                      for i, p in enumerate(prompts)))

    gens = asyncio.run(gen())
    samples = [argparse.Namespace(ids=p + x.token_ids, action_mask=[0] * len(p) + [1] * len(x.token_ids),
                                  routing=x.extra["routing"]) for p, x in zip(prompts, gens)]
    batch = FixedBatch([s.ids for s in samples], [s.action_mask for s in samples], [0.0] * len(samples))
    set_ownership(len(samples), args.split, ctx.world_size)
    own = OWN[ctx.rank]
    out = {}
    for name, routes in (("replayed", dispatch_routes([samples[i] for i in own], "all", actor.replay.spec)),
                         ("own", None)):
        sb, source = step_batch(actor, batch, own, ctx, share=args.share, group=4, routes=routes)
        trainer = actor.compute_logprobs(sb)
        diffs = [(t[len(prompts[i]) - 1:] - torch.tensor(gens[i].logprobs)).abs() for t, i in zip(trainer, source)]
        out[name] = max(float(d.max()) for d in diffs)
        out[f"{name}_tokens_off"] = sum(int((d > 1e-4).sum()) for d in diffs)
    if ctx.is_main:
        torch.save(out, args.out)


def ring(args, ctx) -> None:
    """Ring attention on the ranks' zigzag chunks of packed rows (lone samples, shared prompts, end padding;
    grouped-query heads; with and without a sliding window) in float64 against a float64 softmax over the whole
    row under a dense mask read from the one-process path's own segment layout (`dense_visible`): outputs and
    the gradients of q, k and v of this rank's positions; and against that one-process segment attention
    itself (float32 softmax) to its rounding."""
    from train.parallel.packing import build_packed, prompt_units
    from train.parallel.ring_attention import RING_TILE, FlashCPUKernel, PlainKernel, ring_attention
    from train.parallel.seq_parallel import _segment_attention, packed_attention

    batch = grouped_batch()
    ids = [torch.tensor(x) for x in batch.ids]
    masks = [torch.tensor(m[1:], dtype=torch.float32) for m in batch.action_mask]
    members = list(range(len(ids)))
    units = prompt_units(members, ids, [i // 4 for i in members], 10_000) if args.share else None
    n, r = ctx.world_size, ctx.rank
    whole = build_packed(members, ids, masks, 0, ctx.device, multiple=2 * n, units=units)
    mine = build_packed(members, ids, masks, 0, ctx.device, sp_rank=r, sp_size=n, multiple=2 * n, units=units,
                        ring=n)
    total = whole.total_len
    assert torch.equal(whole.input_ids[0][mine_rows := zigzag(r, n, total)], mine.input_ids[0])
    out = {}
    # tile 8: blocks in several tiles each, some of them wholly masked; the default through packed_attention
    cases = [(window, tile, kernel) for window in (None, 7) for tile in (RING_TILE, 8)
             for kernel in (PlainKernel, FlashCPUKernel)]
    for window, tile, kernel in cases:
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(1, heads, total, 8, generator=g, dtype=torch.float64) for heads in (4, 2, 2))
        weight = torch.randn(1, total, 4, 8, generator=g, dtype=torch.float64)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kk, vv = (t.repeat_interleave(2, 1) for t in leaves[1:])
        scores = (leaves[0] @ kk.transpose(-1, -2)) * 8 ** -0.5
        visible = dense_visible(whole.segment_slots, total, window)
        ref = (torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ vv).transpose(1, 2)  # [1, T, H, d]
        (ref * weight).sum().backward()
        segment = _segment_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), whole.segment_slots,
                                     None, 0.0, window).transpose(1, 2)
        out[f"segment_{window}"] = float((segment - ref).abs().max())
        local = [t[:, :, mine_rows].clone().requires_grad_() for t in (q, k, v)]
        if tile == RING_TILE and kernel is FlashCPUKernel:  # what the trainer calls on CPU
            got, _ = packed_attention(None, *local, None, packed_segments=mine.segment_slots,
                                      cp_group=torch.distributed.group.WORLD, sliding_window=window)
        else:
            got = ring_attention(*local, mine.segment_slots, torch.distributed.group.WORLD, None, window, tile,
                                 kernel).transpose(1, 2)
        (got * weight[:, mine_rows]).sum().backward()
        case = f"{window}_{tile}_{kernel.__name__}"
        out[f"out_{case}"] = float((got - ref[:, mine_rows]).abs().max())
        for name, a, b in zip("qkv", local, leaves):
            out[f"d{name}_{case}"] = float((a.grad - b.grad[:, :, mine_rows]).abs().max())
        out[f"scale_{case}"] = float(leaves[1].grad.abs().max())
    out["shared"] = bool(args.share and any(u.shared for u in units))
    torch.save(out, args.out.replace(".pt", f".rank{r}.pt"))


def dense_visible(segments: tuple, total: int, window: int | None) -> torch.Tensor:
    """[T, T] bool from the segment attention's layout (train/parallel/packing.py segment_slots / shared_slots):
    a whole segment's slot offsets are causal positions; a shared-prompt tail's query i (at prefix + i) sees its
    key list up to prefix + i; the window bounds the position difference."""
    slots, owner = segments[0], segments[1]
    longest, base = slots.shape[1], slots.numel()
    at = torch.empty(total, dtype=torch.long)  # each row position's place in its attention: (group, offset)
    group = torch.empty(total, dtype=torch.long)
    whole = owner < base
    group[whole], at[whole] = owner[whole] // longest, owner[whole] % longest
    visible = (group[:, None] == group[None, :]) & (at[None, :] <= at[:, None]) & whole[:, None] & whole[None, :]
    if window is not None:
        visible &= at[:, None] - at[None, :] < window
    if len(segments) == 5:
        queries, keys, prefix = segments[2], segments[3], segments[4]
        width = queries.shape[1]
        for row in (~whole).nonzero().squeeze(1).tolist():
            tail, i = divmod(int(owner[row]) - base, width)
            for j in range(int(prefix[tail]) + i + 1):
                if window is None or int(prefix[tail]) + i - j < window:
                    visible[row, keys[tail, j]] = True
    return visible


def zigzag(rank: int, n: int, total: int) -> torch.Tensor:
    from train.parallel.seq_parallel import zigzag_rows

    return zigzag_rows(rank, n, total // (2 * n))


def sync(args, ctx) -> None:
    """Verified weight sync through PolicySync (what the trainer calls): an honest push verifies and
    the probe agrees; an engine that silently drops one tensor on the last rank, or whose weights
    drift after the push on rank 0, stops every rank with a WeightSyncError."""
    from train.trainer.policy_sync import PolicySync
    from train.trainer.sync_check import WeightSyncError, actor_logprobs, check_probe

    class Log:  # PolicySync logs only on governor events
        def event(self, *a, **k): ...
        def write(self, *a, **k): ...

    torch.manual_seed(0)
    actor = Actor(actor_cfg(**layout_overrides(args)), ctx, MODEL, pad_token_id=0, train=True, temperature=0.7,
                  total_updates=1)
    engine = HFEngine.from_pretrained(MODEL, device=ctx.device, seed=0)
    with torch.no_grad():  # the engine starts from other weights: the push must bring the actor's
        for p in engine.model.parameters():
            p.add_(0.01)
    policy = PolicySync(actor.model, engine, args.bucket_kb / 1024, None, {"actor": actor}, Log(),
                        verify=True, device=ctx.device, rank=ctx.rank)
    out: dict = {"push_s": policy.push(step=3), "weight_norm": actor.weight_norm(),
                 "full_norm": sum(float((t.double() ** 2).sum())
                                  for _, t in gather_full_tensors(unique_state(actor.model), 1 << 20)) ** 0.5}
    probe = [1, 50, 60, 70, 80, 90, 100, 7, 8, 9]
    out["probe_diff"] = check_probe(engine.score(probe, 0.7), actor_logprobs(actor, probe, ctx.device), 1e-3, 3,
                                    ctx.rank, ctx.device)
    # A silent engine failure: the last rank's engine drops one tensor of the push.
    write, dropped = engine._copy, "model.layers.1.mlp.down_proj.weight"
    targets = engine._named_targets()

    def lossy(into, froms):
        if ctx.rank == ctx.world_size - 1:
            kept = [(t, f) for t, f in zip(into, froms) if t is not targets[dropped]]
            into, froms = [t for t, _ in kept], [f for _, f in kept]
        write(into, froms)

    with torch.no_grad():
        for p in actor.model.parameters():  # new weights, as after an update
            p.to_local().add_(0.001)
    engine._copy = lossy
    try:
        policy.push(step=4)
        out["lossy"] = None
    except WeightSyncError as e:
        out["lossy"] = str(e)
    engine._copy = write
    policy.push(step=5)
    with torch.no_grad():  # rank 0's engine drifts after an honest push
        if ctx.rank == 0:
            targets["model.layers.0.self_attn.q_proj.weight"].mul_(3.0)
    try:
        check_probe(engine.score(probe, 0.7), actor_logprobs(actor, probe, ctx.device), 1e-3, 6, ctx.rank, ctx.device)
        out["drift"] = None
    except WeightSyncError as e:
        out["drift"] = str(e)
    torch.save(out, args.out.replace(".pt", f".rank{ctx.rank}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["vision", "grads", "match", "critic_grads", "reference", "teachers", "lora_reference",
                                         "shared_base", "packing", "router_replay", "ring", "drift",
                                         "collectives", "advantages", "push", "load", "reshard", "sync", "shard_norms",
                                         "bf16_passes", "offload_moments"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--agg", default="all_token_mean")
    parser.add_argument("--split", default="uneven")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--loss", default="ppo")
    parser.add_argument("--entropy", type=float, default=0.0)
    parser.add_argument("--ddp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (a mixture of experts' --model)")
    parser.add_argument("--cp", type=int, default=1, help="context parallel size (ring attention)")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (actor.compile)")
    parser.add_argument("--recompute_above", type=int, default=None,
                        help="grads with --ac: packs of at most this many tokens skip the recompute")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--bucket_kb", type=int, default=256)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--grouped", action="store_true", help="samples in groups that share a prompt")
    parser.add_argument("--share", action="store_true", help="dispatch with share_prompt (lay each prompt out once)")
    parser.add_argument("--fused_head", action="store_true", help="actor.use_liger_kernel: the fused log-prob head")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank of the actor / critic (0: full model)")
    parser.add_argument("--dtype", default="float32", help="the actor's compute dtype (grads, shared_base)")
    parser.add_argument("--masters", default="false", choices=("null", "true", "false"),
                        help="actor/critic.master_weights (false: FSDP2's mixed precision, as before the key)")
    parser.add_argument("--reduce_every_pack", action="store_true",
                        help="grads: reduce gradients after every pack, not once per mini-batch")
    parser.add_argument("--freeze", action="store_true", help="vision: actor.freeze_vision")
    parser.add_argument("--mixed", action="store_true", help="vision: rows of text only among the picture rows")
    parser.add_argument("--critic", action="store_true", help="vision: the critic's values vs a reference too")
    parser.add_argument("--samples", default=None, help="vision: roll out and save the samples here, or load them")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed()
    try:
        {"grads": grads, "match": match, "critic_grads": critic_grads, "reference": reference, "teachers": teachers,
         "lora_reference": lora_reference, "shared_base": shared_base, "router_replay": router_replay, "ring": ring,
         "packing": packing, "collectives": collectives, "advantages": advantages,
         "push": push, "load": load, "reshard": reshard, "sync": sync, "vision": vision,
         "drift": drift, "shard_norms": shard_norms, "bf16_passes": bf16_passes,
         "offload_moments": offload_moments}[args.mode](args, ctx)
    finally:
        cleanup()



def vision_rows(mixed: bool = False) -> list[dict]:
    """Rows whose prompts hold pictures (two rows share one picture: their groups' prompts differ in text only);
    `mixed`: two more rows of text only, whose samples never see a picture (tests/envs/picture_tool.py)."""
    from PIL import Image

    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 30, 30)]
    rows = [{"messages": [{"role": "user", "content": f"Say something plain {i}."}], "answer": None}
            for i in range(2 if mixed else 0)]
    for i, colour in enumerate(colours):
        parts = [{"type": "image", "image": Image.new("RGB", (56 + 14 * i, 56), colour)},
                 {"type": "text", "text": f"What is in picture {i}?" + (" broken" if i == 3 else "")}]
        rows.append({"messages": [{"role": "user", "content": parts}], "answer": None})
    return rows


def vision(args, ctx) -> None:
    """A vision-language actor end to end on this layout: rollouts with pictures in prompts and in tool replies
    (tests/envs/picture_tool.py) through the trainer's RolloutWorker and hf engine, the same on every rank;
    each rank keeps its own samples (the split), dispatches them with their images, and the actor computes
    log-probs (against the sampler's) and one update from fixed advantages. Rank 0 saves what the test compares."""
    from transformers import AutoConfig, AutoTokenizer

    from train.datasets.vision import VisionProcessor
    from train.workers.environment import Environment
    from train.workers.rollout import RolloutWorker

    torch.manual_seed(0)
    cfg = actor_cfg(max_length_per_device=args.max_tokens, max_grad_norm=args.clip, share_prompt=args.share,
                    freeze_vision=args.freeze, **layout_overrides(args))
    actor = Actor(cfg, ctx, args.model, pad_token_id=0, train=True, temperature=1.0, total_updates=1)
    tok = AutoTokenizer.from_pretrained(args.model)
    processor = VisionProcessor.from_pretrained(args.model, tok, AutoConfig.from_pretrained(args.model))
    if args.samples and os.path.exists(args.samples):  # another launch's rollouts: the same samples, whatever batching
        samples = torch.load(args.samples, weights_only=False)
    else:
        engine = HFEngine.from_pretrained(args.model, tok)
        env = Environment(os.path.join(ROOT, "tests", "envs", "picture_tool.py"), timeout_s=30, max_workers=2,
                          max_turns=3)
        worker = RolloutWorker(engine, env, tok, max_turns=3, env_error_reward=-1.0, max_total_length=400,
                               vision=processor)
        try:
            sampling = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=tuple(range(10, 200)))
            samples, _ = worker.rollout(vision_rows(args.mixed), 3, sampling, base_seed=5)
        finally:
            worker.close()
        if args.samples and ctx.is_main:
            torch.save(samples, args.samples)
    n = len(samples)
    set_ownership(n, args.split, ctx.world_size)
    own = OWN[ctx.rank]
    index = exchange_index([len(samples[i].ids) for i in own], [samples[i].group for i in own],
                           [samples[i].reward for i in own], ctx.device)
    sb = dispatch(index, [samples[i].ids for i in own], [samples[i].action_mask for i in own],
                  [samples[i].sampler_logprobs for i in own], actor.layout, 1, ctx.device, share_prompt=args.share,
                  images=[samples[i].images for i in own])
    owners = {(r, j): i for r in range(ctx.world_size) for j, i in enumerate(OWN[r])}
    source = [owners[(index.owner[g], index.local[g])] for g in sb.members]
    logp = actor.compute_logprobs(sb)
    diffs = [((lp - sl) * m).abs().max().item() for lp, sl, m in zip(logp, sb.sampler_logp, sb.mask) if m.any()]
    kl = sum(float(((sl - lp) * m).sum()) for lp, sl, m in zip(logp, sb.sampler_logp, sb.mask)) / max(
        sum(float(m.sum()) for m in sb.mask), 1.0)
    g = torch.Generator().manual_seed(3)
    advantages = torch.randn(n, generator=g).tolist()
    sb.fields["advantages"] = per_token(advantages, sb, source)
    norms, [packs] = actor.prepare(sb, 1)
    shared_packs(packs, args)
    actor.model.train()
    actor.accumulate(packs, norms[0], actor.policy_loss(sb, 32), UpdateStats())
    step_and_save(actor, ctx, args.out)
    critic_diff = critic_values_vs_reference(args, ctx, sb, processor) if args.critic else None
    if ctx.is_main:
        result = torch.load(args.out)
        result["critic_diff"] = critic_diff
        pad = processor.spec.image_token_id
        result.update(max_diff=max(diffs), kl=kl, images=[len(s.images) for s in samples],
                      placeholder_actions=sum(sum(m for t, m in zip(s.ids, s.action_mask) if t == pad) for s in samples),
                      placeholders=[sum(t == pad for t in s.ids) for s in samples],
                      image_tokens=[sum(im.tokens for im in s.images) for s in samples],
                      finish=[s.finish_reason for s in samples], errors=[s.env_error for s in samples],
                      turns=[s.n_turns for s in samples])
        torch.save(result, args.out)


def critic_values_vs_reference(args, ctx, sb: StepBatch, processor) -> float:
    """The critic's values over the packed vision batch vs transformers' own Qwen2.5-VL backbone (SDPA, each
    sample alone, with its pixels at the multimodal positions) under the same (perturbed) value head: the
    largest difference relative to the sample's largest value. One process only (the reference holds the whole model)."""
    from transformers import AutoModel

    from train.models.vlm import mrope_positions

    assert ctx.world_size == 1, "the critic's reference runs in one process"
    critic = Critic(critic_cfg(max_length_per_device=args.max_tokens), ctx, args.model,
                    pad_token_id=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        critic.model.value_head.weight.copy_(torch.randn(critic.model.value_head.weight.shape, generator=g))
    values = critic.compute_values(sb)
    backbone = AutoModel.from_pretrained(args.model, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for ids, images, got in zip(sb.ids, sb.images, values):
            grids = torch.stack([im.grid for im in images])
            hidden = backbone(input_ids=ids[None], position_ids=mrope_positions(ids, grids, processor.spec)[:, None],
                              pixel_values=torch.cat([im.pixel_values for im in images]), image_grid_thw=grids,
                              use_cache=False).last_hidden_state[0]
            want = critic.model.value_head(hidden).squeeze(-1)[:-1]
            worst = max(worst, float((got - want).abs().max()) / float(want.abs().max()))
    return worst


def shard_norms(args, ctx) -> None:
    """optim.clip_grad_norm and Trainable.local_weight_square (what the update calls) on DTensors laid out as the
    trainer lays parameters out on 2 ranks: sharded unevenly (FSDP), replicated, HSDP on a (2, 1) mesh (replicated
    over ddp), and one case with a Partial gradient (the DTensor fallback). Each case's full tensors come from a seed
    (the same on every rank); rank 0 saves the norms and the clipped full gradients, the test checks them in float64."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from train.models import optim
    from train.models.trainable import Trainable

    flat = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ddp", "fsdp"))
    shapes = [(5, 3), (7,), (2, 4), (1, 6)]
    cases = {"fsdp": (flat, [[Shard(0)], [Shard(0)], [Replicate()], [Shard(0)]]),
             "hsdp": (hsdp, [[Replicate(), Shard(0)]] * 4),
             "partial": (flat, [[Shard(0)], [Replicate()], [Partial()], [Shard(0)]])}
    out = {"shapes": shapes}
    for name, (mesh, placements) in cases.items():
        g = torch.Generator().manual_seed(7)
        weights = [torch.randn(s, generator=g) for s in shapes]
        grads = [torch.randn(s, generator=g) for s in shapes]
        params = []
        for w, grad, place in zip(weights, grads, placements):
            partial = place[0].is_partial()  # a replicated weight whose gradient is half on each rank, summed
            p = torch.nn.Parameter(distribute_tensor(w, mesh, [Replicate()] if partial else place))
            p.grad = DTensor.from_local(grad / 2, mesh, place) if partial else distribute_tensor(grad, mesh, place)
            params.append(p)
        holder = SimpleNamespace(model=torch.nn.ParameterList(params), device=torch.device("cpu"), masters=None)
        square = Trainable.local_weight_square(holder)
        weight_norm = all_reduce_sum([square], torch.device("cpu"))[0] ** 0.5
        norm = float(optim.clip_grad_norm(params, max_norm=args.clip))
        full = [p.grad.full_tensor() for p in params]
        out[name] = {"norm": norm, "weight_norm": weight_norm, "clipped": full}
    if ctx.is_main:
        torch.save(out, args.out)


def collectives(args, ctx) -> None:
    """Count the collectives the trainer's own code issues in one step (PPO with a critic, KL to a
    reference, 2 epochs x 2 mini-batches), apart from those inside the model (FSDP, TP, Ulysses,
    DTensor) which torch issues: every torch.distributed call whose nearest caller outside torch is
    in train/ is one."""
    import collections
    import inspect

    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from train.trainer.grpo import Trainer

    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single", "all_to_all", "broadcast",
             "gather", "gather_object", "all_gather_object", "broadcast_object_list", "reduce_scatter_tensor",
             "barrier", "scatter")
    counts: collections.Counter = collections.Counter()
    counting = [False]
    torch_dir = os.path.dirname(torch.__file__)
    # torch's own sharded-model machinery: a collective issued from inside it is FSDP's or DTensor's,
    # whatever code called the module (torch versions differ in how they reach `dist`)
    internal = [os.path.join(torch_dir, "distributed", d) + os.sep for d in ("fsdp", "tensor", "_composable")]

    def wrap(name, fn):
        def counted(*a, **kw):
            if counting[0]:
                for frame in inspect.stack()[1:]:
                    if any(frame.filename.startswith(d) for d in internal):
                        break
                    if frame.filename.startswith(torch_dir):
                        continue
                    if os.sep + "train" + os.sep in frame.filename:
                        counts[f"{name} ({os.path.basename(frame.filename)}:{frame.function})"] += 1
                    break
            return fn(*a, **kw)
        return counted

    for name in names:
        if hasattr(dist, name):  # all_gather_single: torch >= 2.13
            setattr(dist, name, wrap(name, getattr(dist, name)))
    with initialize_config_dir(config_dir=os.path.join(ROOT, "config"), version_base=None):
        cfg = compose(config_name="stub", overrides=[
            f"trainer.save_dir={os.path.dirname(args.out)}/run", "trainer.test_freq=null", "trainer.progress_bar=false",
            "adv.estimator=gae", "actor.kl.coef=0.01", "actor.update_per_rollout=2", "actor.mini_batches=2",
            "critic.update_per_rollout=2", "critic.mini_batches=2", "data.prompts_per_rollout=8",
            "data.responses_per_prompt=4", "rollout.dynamic_filtering=false", "trainer.total_steps=3"])
    trainer = Trainer(cfg, ctx)
    try:
        trainer.train_step(1)  # warm-up: first-use set-up is not per-step traffic
        counting[0] = True
        metrics = trainer.train_step(2)
        counting[0] = False
    finally:
        trainer.close()
    if ctx.is_main:
        torch.save({"counts": dict(counts), "total": sum(counts.values()), "metrics": metrics}, args.out)


ADVANTAGE_CASES = {
    "grpo": {"adv.estimator": "reinforce"},
    "rloo_kl": {"adv.estimator": "rloo", "actor.kl.coef": 0.1, "actor.kl.reward_estimator": "k1"},
    "global_norm": {"adv.estimator": "reinforce", "adv.global_norm": True},
    "batch_whiten": {"adv.estimator": "reinforce", "adv.norm_var": False, "adv.batch_whiten": True},
    "reinforce_pp_baseline": {"adv.estimator": "reinforce_pp_baseline", "actor.kl.coef": 0.05,
                              "actor.kl.reward_estimator": "k1"},
    "gae": {"adv.estimator": "gae", "adv.lamda": 0.9, "adv.gamma": 0.99},
}


def advantages(args, ctx) -> None:
    """Advantages of every estimator for the same samples on 1 or 2 ranks (groups split over dp
    groups by the dispatch), per global sample, to `out` on rank 0."""
    from train.parallel.layout import layout_for
    from train.trainer.advantages import compute_advantages

    batch = fixed_batch(16)
    g = torch.Generator().manual_seed(5)
    rewards = torch.randint(0, 3, (16,), generator=g).double().tolist()  # 4 groups of 4
    ref = [torch.randn(len(s) - 1, generator=g) * 0.2 for s in batch.ids]
    values = [torch.randn(len(s) - 1, generator=g) for s in batch.ids]
    sampler = [[0.0] + (torch.randn(len(s) - 1, generator=g) * 0.1 - 1).tolist() for s in batch.ids]
    own = {1: [list(range(16))], 2: [list(range(8)), list(range(8, 16))]}[ctx.world_size]  # whole groups per rank
    mine = own[ctx.rank]
    layout = layout_for(OmegaConf.create({"ddp_size": 1, "tp_size": 1, "sp_size": 1}), ctx.world_size, "cpu", "actor")
    index = exchange_index([len(batch.ids[i]) for i in mine], [k // 4 for k in range(len(mine))],
                           [rewards[i] for i in mine], ctx.device)
    sb0 = dispatch(index, [batch.ids[i] for i in mine], [batch.action_mask[i] for i in mine],
                   [sampler[i] for i in mine], layout, 1, ctx.device)
    source = [own[index.owner[k]][index.local[k]] for k in sb0.members]
    target, _ = assign(index, layout.sizes.dp, 1)
    split = any(len({target[k] for k in range(index.size) if index.group[k] == grp}) > 1
                for grp in range(index.n_groups))
    out = {}
    for name, overrides in ADVANTAGE_CASES.items():
        cfg = OmegaConf.load(os.path.join(ROOT, "config", "grpo.yaml"))
        for k, v in overrides.items():
            OmegaConf.update(cfg, k, v)
        sb = dispatch(index, [batch.ids[i] for i in mine], [batch.action_mask[i] for i in mine],
                      [sampler[i] for i in mine], layout, 1, ctx.device)
        sb.fields["ref_logp"] = [ref[i] for i in source]
        sb.fields["values"] = [values[i] for i in source]
        metrics = compute_advantages(sb, cfg.adv, cfg.actor.kl, ctx.device)
        mine_adv = {i: (a, sb.fields.get("returns", [None] * len(sb))[j]) for j, (i, a) in
                    enumerate(zip(source, sb.fields["advantages"]))}
        everything = [mine_adv]
        if ctx.world_size > 1:
            everything = [None] * ctx.world_size
            torch.distributed.all_gather_object(everything, mine_adv)
        merged = {k: v for part in everything for k, v in part.items()}
        out[name] = {"per_sample": merged, "metrics": metrics}
    if ctx.is_main:
        torch.save({"cases": out, "split_groups": split}, args.out)


def push(args, ctx) -> None:
    """The weight push's flat-bucket gather against DTensor.full_tensor(), in fp32 and cast to bf16,
    and the number of gathers it issues (one per bucket)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    actor = Actor(actor_cfg(**layout_overrides(args)), ctx, args.model, pad_token_id=0, train=True,
                  temperature=1.0, total_updates=1)
    from train.parallel.collectives import ALL_GATHER_FLAT

    calls = [0]
    real = getattr(dist, ALL_GATHER_FLAT)

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    setattr(dist, ALL_GATHER_FLAT, counted)
    state = list(unique_state(actor.model))
    expected = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for name, t in state}
    result = {}
    for dtype in (None, torch.bfloat16):
        calls[0] = 0
        got = {name: t.clone() for name, t in gather_full_tensors(state, args.bucket_kb * 1024, dtype)}
        err = max(float((got[n].double() - expected[n].to(dtype or expected[n].dtype).double()).abs().max())
                  for n in expected)
        result[str(dtype)] = {"names": list(got), "max_err": err, "gathers": calls[0],
                              "dtypes": sorted({str(t.dtype) for t in got.values()})}
    setattr(dist, ALL_GATHER_FLAT, real)
    sharded = [t for _, t in state if hasattr(t, "placements")]
    if ctx.is_main:
        torch.save({"result": result, "expected_names": [n for n, _ in state],
                    "full_bytes": sum(t.numel() * 4 for t in expected.values()),
                    "sharded": len(sharded)}, args.out)


def load(args, ctx) -> None:
    """The actor and the critic built on the meta device and filled shard by shard, against
    `from_pretrained` in one process: every weight and buffer, and the logits / values of a forward."""
    from transformers import AutoModel, AutoModelForCausalLM

    from train.models.value_model import ValueModel
    from train.parallel.packing import build_packed

    torch.manual_seed(0)
    actor = Actor(actor_cfg(**layout_overrides(args)), ctx, args.model, pad_token_id=0, train=True,
                  temperature=1.0, total_updates=1)
    critic = Critic(critic_cfg(**layout_overrides(args)), ctx, args.model, pad_token_id=0, total_updates=1)
    plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    plain_critic = ValueModel(AutoModel.from_pretrained(args.model, dtype=torch.float32))
    out = {}
    for name, built, ref in (("actor", actor.model, plain), ("critic", critic.model, plain_critic)):
        full = {k: v.clone() for k, v in gather_full_tensors(built.state_dict().items(), 1 << 20)}
        expected = ref.state_dict()
        weights = {k: (full[k].shape == expected[k].shape and torch.equal(full[k], expected[k])) for k in expected}
        buffers = {}
        for (bn, b), (rn, r) in zip(built.named_buffers(), ref.named_buffers()):
            buffers[bn] = bn == rn and torch.equal(b.full_tensor() if hasattr(b, "full_tensor") else b, r)
        out[name] = {"weights": weights, "extra_keys": sorted(set(full) - set(expected)), "buffers": buffers}
    tied = getattr(plain.config, "tie_word_embeddings", False)
    out["tied"] = (not tied) or actor.model.lm_head.weight is actor.model.model.embed_tokens.weight
    # One packed forward on every rank (the same row), compared with the plain models.
    seq = torch.randint(3, plain.config.vocab_size, (23,), generator=torch.Generator().manual_seed(3))
    sp, tp = actor.layout.sizes.sp, actor.layout.sizes.tp
    mb = build_packed([0], [seq], [torch.ones(22)], 0, ctx.device, sp_rank=actor.layout.sp_rank, sp_size=sp,
                      multiple=sp * tp)
    from train.parallel.seq_parallel import gather_sequence

    with torch.no_grad():
        logits = actor.model(**mb.model_inputs(), use_cache=False, sp_group=actor.layout.sp_group).logits[0]
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        if tp > 1:  # column-parallel lm_head: each rank holds a vocabulary slice
            parts = [torch.empty_like(logits) for _ in range(tp)]
            torch.distributed.all_gather(parts, logits.contiguous(), group=actor.layout.tp_group)
            logits = torch.cat(parts, -1)
        logits = gather_sequence(logits, actor.layout.sp_group)[:23]
        values = critic.model(**mb.model_inputs(), sp_group=critic.layout.sp_group)[0]
        values = gather_sequence(values, critic.layout.sp_group)[:23]
        # the same packed attention as the trainer's, so that only the loading can differ
        from train.parallel.seq_parallel import install_packed_attention

        install_packed_attention(plain)
        install_packed_attention(plain_critic)
        whole = build_packed([0], [seq], [torch.ones(22)], 0, ctx.device)
        ref_logits = plain(**whole.model_inputs(), use_cache=False).logits[0][:23]
        ref_values = plain_critic(**whole.model_inputs())[0][:23]
    out["logits_err"] = float((logits - ref_logits).abs().max())
    out["values_err"] = float((values - ref_values).abs().max())
    out["logits_equal"] = bool(torch.equal(logits, ref_logits))
    if ctx.is_main:
        torch.save(out, args.out)


def reshard(args, ctx) -> None:
    """Load a checkpoint saved under another layout or world size (`--ckpt`), save it again at once,
    and let the test compare the two."""
    from train.runtime.checkpoint import Checkpointer

    actor = Actor(actor_cfg(**layout_overrides(args)), ctx, args.model, pad_token_id=0, train=True,
                  temperature=1.0, total_updates=100)
    checkpointer = Checkpointer(os.path.dirname(args.out), ctx)
    state, _ = checkpointer.load(args.ckpt, {"actor": actor})
    checkpointer.save(state["step"], {"actor": actor}, {k: v for k, v in state.items() if k != "schedulers"},
                      {"rng": None})
    checkpointer.close()


if __name__ == "__main__":
    main()
