"""The `hf` engine's sampler per decode step, against its earlier self and transformers' way, on one device.

    .venv/bin/python benchmarks/sampler.py                      # CPU; --device cuda on a GPU

For each (rows, vocabulary) it times one `sample_tokens` call on random logits at temperature 1 (the usual RL
setting: no row filters or is greedy), three ways, in the same process:

* `two-level`: what the engine runs now: no argmax pass (no greedy row), and `inverse_cdf` in two levels
  (block masses, then the running sum inside each row's chosen block);
* `one running sum`: the same call with the two levels off (a cumsum over the whole vocabulary) and the
  argmax computed, as before 2026-11-28;
* `torch.multinomial`: transformers' sampling step (`softmax`, then `multinomial`), the peer; it has no
  per-request seed and returns no log-prob, so it does less than the engine must.

It prints the best of 5 repeats (milliseconds per call) and the ratios, and whether the first two chose the
same tokens (they differ only where float32 rounding puts a row's target on a token boundary).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.engines import sampling  # noqa: E402


def best_ms(fn, device: torch.device, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return 1e3 * min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default="256x151936,64x151936,16x512", help="rows x vocabulary, comma separated")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    print("| rows x vocab | two-level ms | one running sum ms | torch.multinomial ms | speed-up | same tokens |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        rows, vocab = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
        ones, off_k = torch.ones(rows, device=device), torch.full((rows,), -1, device=device)
        u = (1.0 - torch.rand(rows, generator=g, dtype=torch.float64)).to(device)
        nobody = torch.tensor([], dtype=torch.long, device=device)
        calls = 20 if vocab > 10000 else 500

        def engine(two_levels: bool):
            sampling.CDF_BLOCK = 1024 if two_levels else sys.maxsize  # sys.maxsize: one block, one running sum
            return sampling.sample_tokens(logits, ones, ones, off_k, u, any_sampled=True, filtered=nobody,
                                          unit_temperature=True, any_greedy=False if two_levels else None)

        now = best_ms(lambda: engine(True), device, calls)
        tokens_now = engine(True)[0]
        before = best_ms(lambda: engine(False), device, calls)
        tokens_before = engine(False)[0]
        sampling.CDF_BLOCK = 1024
        peer = best_ms(lambda: torch.multinomial(torch.softmax(logits, -1), 1), device, calls)
        print(f"| {rows} x {vocab} | {now:.3f} | {before:.3f} | {peer:.3f} | {before / now:.2f}x over one running "
              f"sum, {peer / now:.2f}x over multinomial | {int((tokens_now == tokens_before).sum())}/{rows} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
