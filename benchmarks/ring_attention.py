"""Ring attention (train/parallel/ring_attention.py) against torch's own attention on the whole row, forward and
backward of one attention layer, on CPU with gloo.

    .venv/bin/python benchmarks/ring_attention.py                          # 4K, 8K, 16K tokens; cp 2 and 4
    .venv/bin/python benchmarks/ring_attention.py --tokens 8192 --cp 2 --repeats 1

For each row length T: the peer is `F.scaled_dot_product_attention(is_causal=True)` on the whole row in one
process (torch's fused CPU flash kernel, one thread): the work the ring splits. Then, for each cp and each tile
kernel (`plain`: the tiles in plain torch; `flash`: torch's CPU flash kernel per tile, what the trainer runs on
CPU), cp processes with one thread each run the ring on their zigzag chunks of the same row (one sequence, SmolLM2's
attention shape: 9 heads, 3 key/value heads, head dim 64, float32). Reported: seconds of forward + backward on the
slowest rank (median of `--repeats`), the ring's efficiency = peer s / (min(cp, cores) x ring s) (1.0: the ring
splits the work over the cores it has with no overhead; with more ranks than cores they time-share them, so
wall time is not the GPU's story), and the largest
difference of the ring's output from the peer's. Rank 0 also reports the seconds its backward spent waiting on
transfers that the compute did not cover.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.parallel import ring_attention as ring  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64


def whole_row(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(HEADS, tokens, DIM, generator=g)
    k, v = (torch.randn(KV_HEADS, tokens, DIM, generator=g) for _ in range(2))
    weight = torch.randn(HEADS, tokens, DIM, generator=g)  # the loss: sum(out * weight)
    return q, k, v, weight


def peer(tokens: int, repeats: int) -> tuple[float, torch.Tensor]:
    """SDPA over the whole row, one process, one thread: median forward + backward seconds, and its output."""
    torch.set_num_threads(1)
    q, k, v, weight = whole_row(tokens)
    times = []
    for _ in range(repeats):
        leaves = [t.clone().requires_grad_() for t in (q, k.repeat_interleave(HEADS // KV_HEADS, 0),
                                                      v.repeat_interleave(HEADS // KV_HEADS, 0))]
        start = time.perf_counter()
        out = F.scaled_dot_product_attention(*(t[None] for t in leaves), is_causal=True)[0]
        (out * weight).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out.detach()


def worker(rank: int, cp: int, tokens: int, kernel_name: str, repeats: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    kernel = {"plain": ring.PlainKernel, "flash": ring.FlashCPUKernel}[kernel_name]
    q, k, v, weight = whole_row(tokens)
    rows = ring.zigzag_rows(rank, cp, tokens // (2 * cp))
    row = ring.RingRow(seg=torch.zeros(tokens, dtype=torch.long), pos=torch.arange(tokens),
                       prefix=torch.full((tokens,), -1))
    waited = []
    wait = ring._wait

    def timed_wait(requests):  # the seconds the backward's waits were not covered by compute
        start = time.perf_counter()
        wait(requests)
        waited.append(time.perf_counter() - start)

    times = []
    for _ in range(repeats):
        leaves = [t[:, rows].clone().requires_grad_() for t in (q, k, v)]
        dist.barrier()
        start = time.perf_counter()
        out = ring.ring_attention(*(t[None] for t in leaves), row, dist.group.WORLD, None, None, kernel=kernel)[0]
        waited.clear()
        ring._wait = timed_wait
        (out * weight[:, rows]).sum().backward()
        ring._wait = wait
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    queue.put((rank, statistics.median(slowest.tolist()), out.detach(), rows, sum(waited)))
    dist.destroy_process_group()


def run_ring(cp: int, tokens: int, kernel: str, repeats: int, port: int) -> tuple[float, torch.Tensor, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, cp, tokens, kernel, repeats, port, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    out = torch.empty(HEADS, tokens, DIM)
    for _, _, part, rows, _ in results:
        out[:, rows] = part
    return results[0][1], out, results[0][4]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,8192,16384", help="comma list of row lengths")
    p.add_argument("--cp", default="2,4", help="comma list of ring sizes")
    p.add_argument("--kernels", default="plain,flash")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}, "
          f"gloo; {HEADS} heads, {KV_HEADS} key/value heads, head dim {DIM}, float32, tile {ring.RING_TILE}\n")
    print("| tokens | layout | kernel | fwd+bwd s (slowest rank) | efficiency | backward's uncovered waits s (rank 0) "
          "| max abs diff from SDPA |")
    print("|---|---|---|---|---|---|---|")
    port = 29600
    for tokens in (int(t) for t in args.tokens.split(",")):
        base, ref = peer(tokens, args.repeats)
        print(f"| {tokens} | 1 process | SDPA (the peer) | {base:.2f} | 1.00 | | |", flush=True)
        for cp in (int(c) for c in args.cp.split(",")):
            for kernel in args.kernels.split(","):
                port += 1
                secs, out, waited = run_ring(cp, tokens, kernel, args.repeats, port)
                print(f"| {tokens} | cp={cp} | {kernel} | {secs:.2f} | {base / (min(cp, os.cpu_count() or 1) * secs):.2f} | {waited:.3f} | "
                      f"{float((out - ref).abs().max()):.1e} |", flush=True)


if __name__ == "__main__":
    main()
