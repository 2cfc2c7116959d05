"""Weight push seconds against their floor, on this machine.

    .venv/bin/python benchmarks/weight_push.py                                  # stub, 1 and 2 ranks
    .venv/bin/python benchmarks/weight_push.py --model .cache/smollm2-135m-instruct --nproc 1 2
    .venv/bin/python benchmarks/weight_push.py --deep      # Qwen2.5-0.5B's 291 tensors at 1/500 of its size

For each rank count, one torchrun builds the actor exactly as the trainer does (FSDP2 over the ranks;
a plain module on one rank) and an `hf` rollout engine per rank, then times, after a warm-up:

* **push**: `PolicySync.push()`, what the trainer runs after every update: the flat-bucket gather of
  the full weights (train/parallel/weight_sync.py), the engine's copy of each bucket into its
  own weights and the verification of every tensor's checksum (`trainer.verify_push`, the default);
* **unverified**: the same push with `trainer.verify_push=false`;
* **gather only**: the same gather without the engine (what the push costs in collectives);
* **floor**: one `all_gather_into_tensor` of the same number of bytes on the same ranks (no
  bucketing, no unpacking, no engine copy): what moving the weights cannot beat. On one rank there is
  no collective, and the floor is one copy of the weights (the engine must receive them), from the actor's
  weights (fp32, or bf16 with `actor.master_weights`) into the engine's dtype.

Reported: seconds per push and per billion parameters, push / floor, and the ops one push dispatches (a
`TorchDispatchMode` count): those that run kernels (on a GPU each a launch or more; on one GPU their count,
not the bytes, sets the push's time), the allocations (a call into the allocator, no kernel) and the views
(metadata only). `--bucket-mb` is `rollout.bucket_size_mb`. `--dtype bfloat16` trains in bf16
(`actor.dtype`) and builds the engine in bf16: one GPU's setting. On one rank the actor then holds bf16 weights
with fp32 masters (`actor.master_weights`, the default), so nothing is cast on the way; `--master-weights false`
is FSDP2 over one rank, whose fp32 weights are each cast on their way. `--lora-rank N` builds the actor with `actor.lora.rank=N` (and the engine
with the same LoRA layers): a push then sends the adapters only (the params column counts what is sent).
`--deep` builds (in a temporary folder) a random Qwen2 of 24 layers and hidden size 64: as many tensors
as Qwen2.5-0.5B (291) with 0.9M parameters, so what it times is the cost per tensor (Python, dispatch,
kernel launches), the part of a GPU push that the bytes do not explain.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def op_count():
    """A dispatch mode sorting the ops that run into kernels (on a GPU, each a launch or more), allocations (a
    call into the allocator, no kernel) and views (metadata only: no kernel, no memory)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCount(TorchDispatchMode):
        ops = allocations = views = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.is_view:
                self.views += 1
            elif func.overloadpacket.__name__ in ALLOCATIONS:
                self.allocations += 1
            else:
                self.ops += 1
            return func(*args, **(kwargs or {}))

    return OpCount()


def worker(args) -> None:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from train.engines.hf import HFEngine
    from train.models.actor import Actor
    from train.models.lora import adapter_state
    from train.parallel.collectives import all_gather_flat
    from train.parallel.distributed import cleanup, init_distributed
    from train.parallel.weight_sync import unique_state
    from train.parallel.weight_sync import gather_full_tensors
    from train.trainer.policy_sync import PolicySync

    torch.set_num_threads(args.threads)
    ctx = init_distributed()
    try:
        cfg = OmegaConf.load(os.path.join(ROOT, "config", "grpo.yaml")).actor
        OmegaConf.update(cfg, "lora.rank", args.lora_rank)
        OmegaConf.update(cfg, "dtype", args.dtype)
        OmegaConf.update(cfg, "master_weights", {"null": None, "true": True, "false": False}[args.master_weights])
        actor = Actor(cfg, ctx, args.model, pad_token_id=0, train=True, temperature=1.0)
        engine = HFEngine.from_pretrained(args.model, device=ctx.device, lora=actor.lora if args.lora_rank else None,
                                          dtype=args.dtype)
        sync = PolicySync(actor.model, engine, args.bucket_mb, None, {"actor": actor}, log=None)
        unverified = PolicySync(actor.model, engine, args.bucket_mb, None, {"actor": actor}, log=None, verify=False)
        pushed = (lambda: adapter_state(actor.model)) if args.lora_rank else (lambda: unique_state(actor.model))
        n_params = sum(t.numel() for _, t in pushed())
        cast = engine.dtype

        def gather_only() -> None:
            for _ in gather_full_tensors(pushed(), sync.bucket_bytes, engine.dtype):
                pass

        flat = torch.zeros(-(-n_params // ctx.world_size), dtype=cast)
        out = torch.empty(flat.numel() * ctx.world_size, dtype=cast)
        # the actor's weights: fp32, or the bf16 ones its fp32 masters are cast into (actor.master_weights)
        source = torch.zeros(n_params, dtype=cast if actor.masters is not None else torch.float32)
        target = torch.empty(n_params, dtype=cast)

        def floor() -> None:
            if ctx.world_size > 1:
                all_gather_flat(out, flat)
            else:
                target.copy_(source)  # one copy of the weights into the engine's storage

        timings = {}
        for name, fn in (("push", sync.push), ("unverified", unverified.push), ("gather_only", gather_only),
                         ("floor", floor)):
            fn()  # warm-up
            times = []
            for _ in range(args.repeats):
                if dist.is_initialized():
                    dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            timings[name] = statistics.median(times)
        for name, fn in (("push", sync.push), ("unverified", unverified.push)):
            with op_count() as count:
                fn()
            timings[f"{name}_ops"], timings[f"{name}_views"] = count.ops, count.views
            timings[f"{name}_allocations"] = count.allocations
        if ctx.is_main:
            with open(args.out, "w") as f:
                json.dump({"ranks": ctx.world_size, "params": n_params, **timings}, f)
    finally:
        cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "stub", "model"))
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lora-rank", type=int, default=0, help="actor.lora.rank (0: full weights)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="actor.dtype and the engine's dtype (bfloat16: fp32 masters cast to bf16, as on a GPU)")
    p.add_argument("--master-weights", default="null", choices=("null", "true", "false"),
                   help="actor.master_weights (null: the trainer's default, on with one rank in bfloat16)")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--deep", action="store_true", help="a 24-layer, hidden-64 Qwen2 built here (per-tensor costs)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.deep:
        with tempfile.TemporaryDirectory() as folder:
            args.model = build_deep(folder)
            return run(args)
    return run(args)


def build_deep(folder: str) -> str:
    """A random Qwen2 with Qwen2.5-0.5B's layer count and tensor names, hidden size 64, the stub's tokenizer
    (gpu_suite.write_model, which builds the GPU suite's models)."""
    import dataclasses

    from gpu_suite import TINY, write_model

    deep = dataclasses.replace(TINY, hidden=64, layers=24, heads=2, kv_heads=1, intermediate=128, vocab=512)
    return str(write_model(deep, Path(folder)))


def run(args) -> None:
    rows = []
    for n in args.nproc:
        threads = max(1, args.cores // n)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                   os.path.abspath(__file__), "--worker", "--model", args.model, "--bucket-mb", str(args.bucket_mb),
                   "--repeats", str(args.repeats), "--threads", str(threads), "--out", out.name,
                   "--lora-rank", str(args.lora_rank), "--dtype", args.dtype,
                   "--master-weights", args.master_weights]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            rows.append(json.load(open(out.name)))
    what = f", LoRA rank {args.lora_rank} (adapters pushed)" if args.lora_rank else ""
    what += f", {args.dtype}" if args.dtype != "float32" else ""
    what += f", actor.master_weights={args.master_weights}" if args.master_weights != "null" else ""
    print(f"model {'deep (24 x 64)' if args.deep else os.path.relpath(args.model, ROOT)}{what}, bucket {args.bucket_mb:g} MB, median of {args.repeats}")
    print("| ranks | params | push s | unverified s | gather only s | floor s | push s per 1B params | push / floor "
          "| kernel ops per push (unverified) | allocations | views |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_b = r["push"] / r["params"] * 1e9
        print(f"| {r['ranks']} | {r['params'] / 1e6:.1f}M | {r['push']:.4f} | {r['unverified']:.4f} | "
              f"{r['gather_only']:.4f} | {r['floor']:.4f} | {per_b:.1f} | {r['push'] / max(r['floor'], 1e-9):.1f}x "
              f"| {r['push_ops']} ({r['unverified_ops']}) | {r['push_allocations']} ({r['unverified_allocations']}) "
              f"| {r['push_views']} ({r['unverified_views']}) |")


if __name__ == "__main__":
    main()
