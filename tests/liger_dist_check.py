"""Run under torchrun (gloo, CPU) by tests/test_fused_logprobs.py: the actor with
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
from train.utils.distributed import barrier, cleanup, init_distributed  # noqa: E402
from train.workers.actor import Actor, TrainBatch  # noqa: E402


def batch(n: int = 6, vocab: int = 300) -> TrainBatch:
    g = torch.Generator().manual_seed(1234)
    ids, masks, adv, sampler = [], [], [], []
    for _ in range(n):
        length = int(torch.randint(8, 30, (1,), generator=g))
        ids.append(torch.randint(3, vocab, (length,), generator=g).tolist())
        prompt = int(torch.randint(2, length // 2, (1,), generator=g))
        masks.append([0] * prompt + [1] * (length - prompt))
        adv.append(float(torch.randn(1, generator=g)))
        sampler.append(torch.zeros(length - 1))
    return TrainBatch(ids, masks, adv, sampler)


def run(ctx, fused: bool) -> dict:
    torch.manual_seed(0)
    cfg = OmegaConf.load(ROOT / "config" / "grpo.yaml").actor
    cfg.model_name = str(ROOT / "stub" / "model")
    cfg.use_liger_kernel = fused
    cfg.max_length_per_device = 64  # several micro-batches
    cfg.entropy.coef = 0.01  # the entropy gradient is exercised too
    actor = Actor(cfg, ctx, cfg.model_name, pad_token_id=0, train=True, temperature=0.7, total_updates=1)
    b = batch()
    mine = list(range(ctx.rank, len(b.ids), ctx.world_size))
    # compute_logprobs is exact on action positions only (the plain path skips prompt logits)
    logp = [lp * torch.tensor(m[1:], dtype=lp.dtype) for lp, m in zip(actor.compute_logprobs(b.ids, b.action_mask),
                                                                    b.action_mask)]
    sums: dict = {}
    actor.accumulate_gradients(b, mine, 32, sums, {})
    grads = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
    return {"logp": logp, "grads": grads, "entropy": sums["entropy"], "loss": sums["loss"]}


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
