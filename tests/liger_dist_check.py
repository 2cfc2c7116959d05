"""Run under torchrun (gloo, CPU) by tests/integration/test_fused_logprobs.py: the actor with
actor.use_liger_kernel=true vs false on the stub model under FSDP2 gives the same log-probs,
entropy and gradients. Rank 0 saves both to --out."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from train.models.actor import Actor  # noqa: E402
from train.models.trainable import UpdateStats  # noqa: E402
from train.parallel.collectives import barrier  # noqa: E402
from train.parallel.distributed import cleanup, init_distributed  # noqa: E402
from train.parallel.step_batch import dispatch, exchange_index  # noqa: E402


def batch(n: int = 6, vocab: int = 300) -> tuple[list[list[int]], list[list[int]], list[float]]:
    g = torch.Generator().manual_seed(1234)
    ids, masks, adv = [], [], []
    for _ in range(n):
        length = int(torch.randint(8, 30, (1,), generator=g))
        ids.append(torch.randint(3, vocab, (length,), generator=g).tolist())
        prompt = int(torch.randint(2, length // 2, (1,), generator=g))
        masks.append([0] * prompt + [1] * (length - prompt))
        adv.append(float(torch.randn(1, generator=g)))
    return ids, masks, adv


def run(ctx, fused: bool) -> dict:
    torch.manual_seed(0)
    cfg = OmegaConf.load(ROOT / "config" / "grpo.yaml").actor
    cfg.model_name = str(ROOT / "stub" / "model")
    cfg.use_liger_kernel = fused
    cfg.max_length_per_device = 64  # several micro-batches
    cfg.entropy.coef = 0.01  # the entropy gradient is exercised too
    actor = Actor(cfg, ctx, cfg.model_name, pad_token_id=0, train=True, temperature=0.7, total_updates=1)
    ids, masks, adv = batch()
    mine = list(range(ctx.rank, len(ids), ctx.world_size))  # the samples this rank rolled out
    index = exchange_index([len(ids[i]) for i in mine], list(range(len(mine))), [0.0] * len(mine), ctx.device)
    sb = dispatch(index, [ids[i] for i in mine], [masks[i] for i in mine], [[0.0] * len(ids[i]) for i in mine],
                  actor.layout, 1, ctx.device)
    source = [mine[index.local[g]] if index.owner[g] == ctx.rank else
              list(range(index.owner[g], len(ids), ctx.world_size))[index.local[g]] for g in sb.members]
    # compute_logprobs is exact on action positions only (the plain path skips prompt logits)
    logp = {i: lp * m for i, lp, m in zip(source, actor.compute_logprobs(sb), sb.mask)}
    sb.fields["advantages"] = [adv[i] * m for i, m in zip(source, sb.mask)]
    norms, [packs] = actor.prepare(sb, 1)
    stats = UpdateStats()
    actor.model.train()
    actor.accumulate(packs, norms[0], actor.policy_loss(sb, 32), stats)
    grads = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
    return {"logp": logp, "grads": grads, "entropy": stats.sums["entropy"], "loss": stats.sums["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ctx = init_distributed()
    torch.set_num_threads(1)
    plain, fused = run(ctx, False), run(ctx, True)
    if ctx.is_main:
        torch.save({"plain": plain, "fused": fused}, args.out)
    barrier()  # no rank tears down while another still talks to it
    cleanup()
    # Once (in ~40 launches) a rank aborted at interpreter exit with "terminate called without an
    # active exception" (a C++ thread destroyed during teardown, after all work was done and
    # saved); leave without the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
