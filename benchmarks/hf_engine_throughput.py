"""Decode throughput of the `hf` rollout engine (tokens/s) at a few batch sizes.

    .venv/bin/python benchmarks/hf_engine_throughput.py --model stub/model --device cpu --threads 1
    .venv/bin/python benchmarks/hf_engine_throughput.py --model <hf dir> --device cuda --batch 64 256 --new 256

Every request samples `--new` tokens (EOS is ignored so the lengths are fixed); one untimed warm-up
batch runs first. Prints one JSON line per batch size: device, dtype, batch, tokens, seconds, tokens/s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `train` is beside benchmarks/

from train.engines.base import SamplingParams  # noqa: E402
from train.engines.hf import HFEngine  # noqa: E402


def run(engine: HFEngine, batch: int, prompt_len: int, new: int, seed: int) -> tuple[int, float]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size or 100
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(max_new_tokens=new, temperature=1.0)

    async def main():
        return await asyncio.gather(*(engine.generate(p, sp) for p in prompts))

    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = asyncio.run(main())
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return sum(len(g.token_ids) for g in out), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="stub/model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = HFEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device, eos_token_ids=[])
    try:
        run(engine, min(args.batch), args.prompt, 4, seed=0)  # warm-up
        for batch in args.batch:
            tokens, seconds = run(engine, batch, args.prompt, args.new, seed=batch)
            print(json.dumps({"device": str(engine.device), "dtype": str(next(engine.model.parameters()).dtype),
                              "model": args.model, "batch": batch, "prompt": args.prompt, "new": args.new,
                              "tokens": tokens, "seconds": round(seconds, 3),
                              "tokens_per_s": round(tokens / seconds, 1)}), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
