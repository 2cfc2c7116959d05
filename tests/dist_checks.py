"""Checks that need a real process group; launched by tests with torchrun (1 or 2 ranks).

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_checks.py grads --out F ...
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train.engines.base import SamplingParams  # noqa: E402
from train.engines.hf import HFEngine  # noqa: E402
from train.utils.distributed import cleanup, init_distributed  # noqa: E402
from train.workers.actor import Actor, TrainBatch  # noqa: E402
from train.workers.critic import Critic, CriticBatch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "stub", "model")


def actor_cfg(**overrides):
    cfg = OmegaConf.load(os.path.join(ROOT, "config", "grpo.yaml")).actor
    cfg.model_name = MODEL
    cfg.lr = 1e-3
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def fixed_batch(n: int = 10, vocab: int = 300) -> TrainBatch:
    """Ragged sequences with multi-turn style action masks; the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    ids, masks, adv, sampler = [], [], [], []
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
        sampler.append(torch.zeros(length - 1))
    return TrainBatch(ids, masks, adv, sampler)


def shard(batch: TrainBatch, index: list[int]) -> TrainBatch:
    return TrainBatch([batch.ids[i] for i in index], [batch.action_mask[i] for i in index],
                      [batch.advantages[i] for i in index], [batch.sampler_logp[i] for i in index])


UNEVEN = {1: [0], 2: [0, 7], 4: [0, 3, 5, 9]}  # where each rank's own samples start


def own_samples(n: int, split: str, rank: int, world: int) -> list[int]:
    """The samples a rank rolled out itself: an uneven split, or all on rank 0 (e.g. every group of
    the other ranks was filtered)."""
    if split == "all_on_rank0":
        return list(range(n)) if rank == 0 else []
    starts = UNEVEN[world] + [n]
    return list(range(starts[rank], starts[rank + 1]))


def layout_overrides(args) -> dict:
    return {"ddp_size": args.ddp, "tp_size": args.tp, "sp_size": args.sp,
            "offload_model": args.offload, "offload_optimizer": args.offload, "gradient_checkpointing": args.ac}


def grads(args, ctx) -> None:
    torch.manual_seed(0)
    cfg = actor_cfg(agg_mode=args.agg, max_length_per_device=args.max_tokens, max_grad_norm=args.clip,
                    loss=args.loss, **{"entropy.coef": args.entropy}, **layout_overrides(args))
    actor = Actor(cfg, ctx, args.model, pad_token_id=0, train=True, temperature=1.0, total_updates=1)
    batch = fixed_batch()
    index = own_samples(len(batch.ids), args.split, ctx.rank, ctx.world_size)
    local = shard(batch, index)
    actor.accumulate_gradients(local, list(range(len(index))), 32, {}, {})  # metrics unused here
    step_and_save(actor, ctx, args.out)


def step_and_save(worker, ctx, out) -> None:
    """Full gradients, the optimizer step's (clipped) norm and the updated full weights, to `out` on rank 0."""
    params = worker.model.named_parameters
    grads = {name: p.grad.full_tensor().clone() for name, p in params()}
    norm = worker._optimizer_step()
    weights = {name: p.full_tensor().detach().clone() for name, p in params()}
    if ctx.is_main:
        torch.save({"grads": grads, "norm": norm, "weights": weights}, out)


def packing(args, ctx) -> None:
    """Packed actor vs a plain per-sequence reference (see tests/test_packing.py)."""
    from train.workers.base import load_causal_lm

    torch.manual_seed(0)
    cfg = actor_cfg(max_length_per_device=48)
    actor = Actor(cfg, ctx, MODEL, pad_token_id=0, train=True, temperature=0.7, total_updates=1)
    batch = fixed_batch()
    n = len(batch.ids)
    packs = len(actor._micro_batches(list(range(n)), batch.ids, batch.action_mask, 48))
    logp = actor.compute_logprobs(batch.ids, batch.action_mask)
    actor.accumulate_gradients(batch, list(range(n)), 32, {}, {})
    got = {name: p.grad.full_tensor().clone() for name, p in actor.model.named_parameters()}
    plain = load_causal_lm(MODEL)
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
                               **layout_overrides(args)), ctx, args.model, pad_token_id=0, total_updates=1)
    with torch.no_grad():  # a non-zero head, so the backbone gets gradients too
        g = torch.Generator().manual_seed(7)
        w = torch.randn(critic.model.value_head.weight.shape, generator=g) * 0.1
        weight = critic.model.value_head.weight
        weight.copy_(torch.distributed.tensor.distribute_tensor(w, weight.device_mesh, weight.placements))
    batch = fixed_batch()
    g = torch.Generator().manual_seed(99)
    returns = [torch.randn(len(s) - 1, generator=g) for s in batch.ids]
    old = [torch.randn(len(s) - 1, generator=g) * 0.1 for s in batch.ids]
    index = own_samples(len(batch.ids), args.split, ctx.rank, ctx.world_size)
    local_batch = CriticBatch([batch.ids[i] for i in index], [batch.action_mask[i] for i in index],
                              [returns[i] for i in index], [old[i] for i in index])
    sums: dict = {}
    critic.accumulate_gradients(local_batch, list(range(len(index))), sums)
    step_and_save(critic, ctx, args.out)


def reference(args, ctx) -> None:
    """The reference actor shares no storage with the policy and does not move when the policy trains."""
    torch.manual_seed(0)
    cfg = actor_cfg(**{"kl.coef": 0.5, "kl.type": "low_var_kl"})
    actor = Actor(cfg, ctx, MODEL, pad_token_id=0, train=True, temperature=1.0, total_updates=4)
    ref = Actor(cfg, ctx, MODEL, pad_token_id=0, train=False, temperature=1.0)
    before = {k: v.clone() for k, v in ref.named_full_tensors()}
    ptrs = lambda m: {t.to_local().untyped_storage().data_ptr() for t in m.state_dict().values()}  # noqa: E731
    shared = ptrs(actor.model) & ptrs(ref.model)
    batch = fixed_batch()
    batch.ref_logp = ref.compute_logprobs(batch.ids, batch.action_mask)
    kls = []
    for _ in range(3):
        kls.append(actor.update(batch, 32)["actor/kl"])
    after = dict(ref.named_full_tensors())
    moved = max(float((after[k] - v).abs().max()) for k, v in before.items())
    policy_moved = max(float((dict(actor.named_full_tensors())[k] - v).abs().max()) for k, v in before.items())
    if ctx.is_main:
        torch.save({"shared": len(shared), "ref_moved": moved, "policy_moved": policy_moved, "kls": kls,
                    "ref_requires_grad": any(p.requires_grad for p in ref.model.parameters())}, args.out)


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
    ids = [p + g.token_ids for p, g in zip(prompts, gens)]
    masks = [[0] * len(p) + [1] * len(g.token_ids) for p, g in zip(prompts, gens)]
    trainer = actor.compute_logprobs(ids, masks)
    diffs = [float((t[len(p) - 1:] - torch.tensor(g.logprobs)).abs().max())
             for t, p, g in zip(trainer, prompts, gens)]
    # One real update, then the push: the engine must hold exactly the actor's new weights.
    batch = TrainBatch(ids, masks, [1.0, -1.0] * 3, [torch.zeros(len(s) - 1) for s in ids])
    actor.update(batch, 20)
    engine.update_weights(actor.named_full_tensors())
    engine_sd = engine.model.state_dict()
    push_diff = max(float((v - engine_sd[k]).abs().max()) for k, v in actor.named_full_tensors())
    changed = asyncio.run(gen())
    if ctx.is_main:
        torch.save({"max_logprob_diff": max(diffs), "push_diff": push_diff,
                    "changed": any(a.token_ids != b.token_ids for a, b in zip(gens, changed))}, args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["grads", "match", "critic_grads", "reference", "packing"])
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
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing")
    parser.add_argument("--model", default=MODEL)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed()
    try:
        {"grads": grads, "match": match, "critic_grads": critic_grads, "reference": reference,
         "packing": packing}[args.mode](args, ctx)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
