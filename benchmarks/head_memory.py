"""The log-prob head's memory and time, plain against fused, from its forward through its backward.

    .venv/bin/python benchmarks/head_memory.py          # CPU, ~1 minute; --device cuda on a GPU

At a 150k vocabulary the head is the largest single allocation of a long update: every [tokens, vocab] float32
tensor is 0.6 GB per 1,000 tokens. This runs the two heads the actor has, as it calls them, on random hidden
states and an lm_head weight in bf16: the plain one (train/algorithms/logits.py `head_logprobs_entropy` on the
full logits) and the fused one (train/parallel/fused_logprobs.py: a chunk of 2048 tokens at a time, logits
recomputed in the backward), each without and with an entropy bonus (the entropy's graph). It prints the most
bytes the head's own tensors held at once (train/utils/live_bytes.py on CPU, the allocator's peak on CUDA) per
token and vocabulary entry for the plain head and per chunk token and entry for the fused one, what
train/models/memory_plan.py `head_bytes` plans for each, and the median seconds of forward + backward.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.algorithms.logits import head_logprobs_entropy  # noqa: E402
from train.models.memory_plan import head_bytes  # noqa: E402
from train.parallel.fused_logprobs import DEFAULT_CHUNK_TOKENS, fused_logprobs_entropy  # noqa: E402
from train.utils.live_bytes import LiveBytes  # noqa: E402


def run_head(fused: bool, bonus: bool, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             temperature: float) -> None:
    if fused:
        lp, ent = fused_logprobs_entropy(hidden, weight, labels, temperature, use_liger=False)
    else:
        lp, ent = head_logprobs_entropy(hidden @ weight.t(), labels, temperature, entropy_grad=bonus)
    loss = lp.sum() + (0.01 * ent.sum() if bonus else 0 * ent.detach().sum())
    loss.backward()


def peak_bytes(device: torch.device, run) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with LiveBytes() as held:
        run()
    return held.peak


def measure(device: torch.device, tokens: int, vocab: int, hidden_size: int, temperature: float = 0.7,
            repeats: int = 3) -> list[dict]:
    """One row per head (plain, fused) and entropy bonus (no, yes): `peak_bytes` (what the head's own tensors
    held at once, forward through backward), `planned_bytes` (memory_plan.head_bytes), `unit` (the [tokens, vocab]
    entries the peak is counted per: one chunk's for the fused head) and `seconds` (median forward + backward)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).bfloat16().to(device).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).bfloat16().to(device)
    weight.requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    config = SimpleNamespace(vocab_size=vocab, hidden_size=hidden_size)
    rows = []
    for fused in (False, True):
        for bonus in (False, True):
            def once() -> None:
                run_head(fused, bonus, hidden, weight, labels, temperature)
            peak = peak_bytes(device, once)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                once()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            hidden.grad = weight.grad = None
            rows.append({"head": "fused" if fused else "plain", "entropy_bonus": bonus, "tokens": tokens,
                         "peak_bytes": peak, "unit": (min(tokens, DEFAULT_CHUNK_TOKENS) if fused else tokens) * vocab,
                         "planned_bytes": head_bytes(config, tokens, fused=fused, trained=True, entropy=bonus),
                         "seconds": statistics.median(times)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(f"{args.tokens} tokens, vocabulary {args.vocab}, hidden {args.hidden}, bf16, T {args.temperature}, "
          f"{device.type}; the fused head's chunk {DEFAULT_CHUNK_TOKENS} tokens\n")
    print("| head | entropy bonus | peak (bytes per token x vocab entry) | planned (head_bytes) | seconds |")
    print("|---|---|---|---|---|")
    for r in measure(device, args.tokens, args.vocab, args.hidden, args.temperature, args.repeats):
        print(f"| {r['head']} | {'yes' if r['entropy_bonus'] else 'no'} | {r['peak_bytes'] / r['unit']:.1f} "
              f"| {r['planned_bytes'] / r['unit']:.1f} | {r['seconds']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
