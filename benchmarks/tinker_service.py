"""The Tinker-compatible service's overhead: the same work through the official SDK and HTTP, and on the
service's own parts in this process.

    .venv/bin/python benchmarks/tinker_service.py [--steps 5] [--datums 16] [--tokens 64] [--samples 32]

- train: `forward_backward` (importance_sampling) + `optim_step` on one batch, tokens/s, through the SDK against
  TrainedModel.forward_backward + optim_step directly (the functions the service runs), same batch and steps.
- sample: `sample` requests sent at once (num_samples=1 each, as tinker-cookbook sends them), generated
  tokens/s, through the SDK against the `hf` engine's generate directly, same prompts, seeds and lengths.
The service runs with one rank on this machine's CPU (OMP_NUM_THREADS=1, as the direct runs here).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STUB = ROOT / "stub" / "model"


def make_batch(n: int, length: int, seed: int = 0):
    g = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ids = g.integers(3, 400, length + 1).tolist()
        rows.append((ids[:-1], np.array(ids[1:]), g.uniform(-8, -5, length).astype(np.float32),
                     g.normal(0, 1, length).astype(np.float32)))
    return rows


def via_sdk(url: str, rows, steps: int, prompts, max_tokens: int) -> tuple[float, float]:
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    tc = client.create_lora_training_client(base_model="stub", rank=8, seed=0).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints(i), loss_fn_inputs={
        "target_tokens": t.tolist(), "logprobs": q.tolist(), "advantages": a.tolist()}) for i, t, q, a in rows]
    adam = types.AdamParams(learning_rate=1e-4)
    tc.forward_backward(data, "importance_sampling").result()  # warm-up
    tc.optim_step(adam).result()
    start = time.perf_counter()
    for _ in range(steps):
        f, o = tc.forward_backward(data, "importance_sampling"), tc.optim_step(adam)
        f.result(), o.result()
    train = steps * sum(len(r[0]) for r in rows) / (time.perf_counter() - start)
    sampler = client.create_sampling_client(base_model="stub")
    params = [types.SamplingParams(max_tokens=max_tokens, seed=i, stop=[]) for i in range(len(prompts))]
    sampler.sample(types.ModelInput.from_ints(prompts[0]), 1, params[0]).result()  # warm-up
    start = time.perf_counter()
    futures = [sampler.sample(types.ModelInput.from_ints(p), 1, sp) for p, sp in zip(prompts, params)]
    generated = sum(len(f.result().sequences[0].tokens) for f in futures)
    return train, generated / (time.perf_counter() - start)


def direct(rows, steps: int, prompts, max_tokens: int) -> tuple[float, float]:
    from train.engines.base import SamplingParams
    from train.engines.hf import HFEngine
    from train.tinker_service.trainee import AdamStep, TrainedModel, lora_settings
    from train.tinker_service.wire import Datum

    model = TrainedModel(str(STUB), lora_settings(8), 0, torch.device("cpu"))
    data = [Datum(i, {"target_tokens": t, "logprobs": q, "advantages": a}) for i, t, q, a in rows]
    model.forward_backward(data, "importance_sampling", {}, False)
    model.optim_step(AdamStep())
    start = time.perf_counter()
    for _ in range(steps):
        model.forward_backward(data, "importance_sampling", {}, False)
        model.optim_step(AdamStep())
    train = steps * sum(len(r[0]) for r in rows) / (time.perf_counter() - start)
    engine = HFEngine.from_pretrained(str(STUB))
    params = [SamplingParams(max_new_tokens=max_tokens, seed=i, ignore_eos=True) for i in range(len(prompts))]

    async def go(ps):
        return await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(ps, params)))
    asyncio.run(go(prompts[:1]))
    start = time.perf_counter()
    generated = sum(len(g.token_ids) for g in asyncio.run(go(prompts)))
    engine.close()
    return train, generated / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--datums", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from train.utils.services import free_port, running_all

    rows = make_batch(args.datums, args.tokens)
    prompts = [r[0][:16] for r in make_batch(args.samples, 16, seed=1)]
    port = free_port()
    cmd = [sys.executable, "-m", "train.tinker_service", "--base-model", f"stub={STUB}", "--port", str(port),
           "--root", "/tmp/tinker_bench_root"]
    log = Path("/tmp/tinker_bench_service.log")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with running_all({"tinker": (cmd, f"http://127.0.0.1:{port}/api/v1/healthz", log)}, cwd=ROOT, env=env):
        sdk_train, sdk_sample = via_sdk(f"http://127.0.0.1:{port}", rows, args.steps, prompts, args.max_tokens)
    own_train, own_sample = direct(rows, args.steps, prompts, args.max_tokens)
    print(f"{'':34}{'service (SDK)':>16}{'direct':>12}{'service / direct':>18}")
    print(f"{'forward_backward+optim_step tok/s':34}{sdk_train:16.0f}{own_train:12.0f}{sdk_train / own_train:18.2f}")
    print(f"{'sampling generated tok/s':34}{sdk_sample:16.0f}{own_sample:12.0f}{sdk_sample / own_sample:18.2f}")


if __name__ == "__main__":
    main()
