"""Sampler-trainer mismatch of a mixture of experts with and without router replay (actor.router_replay).

A random Qwen3-MoE-shaped model built in code (nothing downloaded): the hf engine samples with its routing
recorded (the trainer's engine, train/engines/hf.py), the trainer's side recomputes each sample in one
forward, routed by itself or replaying the sampler's experts (train/models/router_replay.py's RouterReplay,
as the actor installs it). Both sides in float32, then both in bfloat16. Reported per setting: KL(sampler ||
trainer) per action token (the k3 estimate the trainer logs as actor/sampler_kl), the mean |log-prob
difference|, and the share of (position, layer) records whose top-k set differs from the trainer's own.

    .venv/bin/python benchmarks/router_replay.py                # ~1 min on 2 CPU cores
    .venv/bin/python benchmarks/router_replay.py --experts 64 --top-k 8 --samples 64
"""
from __future__ import annotations

import argparse
import asyncio
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from train.algorithms.mismatch import sampler_mismatch_sums
from train.engines.base import SamplingParams
from train.engines.hf import HFEngine
from train.models.router_replay import RouterReplay, RoutingRecorder, moe_routers


def build_model(experts: int, top_k: int, layers: int, seed: int) -> torch.nn.Module:
    config = AutoConfig.for_model("qwen3_moe", vocab_size=512, hidden_size=128, intermediate_size=256,
                                  moe_intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, num_experts=experts, num_experts_per_tok=top_k,
                                  norm_topk_prob=True, max_position_embeddings=512)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for router in moe_routers(model):  # a trained router's spread: a few experts clearly preferred per token
            router.weight.normal_(0, 0.3)
    return model.eval()


def measure(model: torch.nn.Module, dtype: torch.dtype, samples: int, new_tokens: int) -> dict[str, float]:
    engine = HFEngine(model.to(dtype), eos_token_ids=[], record_routing=True, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (int(torch.randint(8, 32, (1,), generator=g)),), generator=g).tolist()
               for _ in range(samples)]

    async def generate():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=new_tokens, seed=i))
                                      for i, p in enumerate(prompts)))

    gens = asyncio.run(generate())
    trainer = engine.model  # the same weights; the engine's forward batched and cached, the trainer's whole
    recorder = RoutingRecorder(trainer)
    replay = RouterReplay(trainer)
    out: dict[str, float] = {}
    for mode in ("own", "replayed"):
        kl = diff = flips = records = tokens = 0.0
        for prompt, gen in zip(prompts, gens):
            ids = torch.tensor([prompt + gen.token_ids])
            routing = gen.extra["routing"]
            routes = replay.spec.empty(ids.shape[1])  # the last position never ran in the engine: its own routing
            routes[: routing.shape[0]] = routing
            replay.set(routes if mode == "replayed" else None)
            recorder.clear()
            with torch.no_grad():
                logits = trainer(ids).logits[0, len(prompt) - 1:-1].float()
            own = recorder.take()[: routing.shape[0]]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
            sums = sampler_mismatch_sums(logp, torch.tensor(gen.logprobs), torch.ones_like(logp))
            kl, diff, tokens = kl + float(sums["kl"]), diff + float(sums["abs_diff"]), tokens + logp.numel()
            if mode == "own":
                flips += float((own.long().sort(-1).values != routing.long().sort(-1).values).any(-1).sum())
                records += own.shape[0] * own.shape[1]
        out[f"{mode}/sampler_kl"] = kl / tokens
        out[f"{mode}/sampler_abs_diff"] = diff / tokens
        if mode == "own":
            out["flipped_records"] = flips / records
    replay.clear()
    recorder.remove()
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(args.experts, args.top_k, args.layers, args.seed)
        rows[str(dtype).removeprefix("torch.")] = measure(model, dtype, args.samples, args.new_tokens)
    print(json.dumps(rows, indent=1))
    print("\n| dtype | flipped (position, layer) records | KL own routing | KL replayed | abs diff own | abs diff replayed |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['flipped_records']:.2%} | {r['own/sampler_kl']:.2e} | {r['replayed/sampler_kl']:.2e} | "
              f"{r['own/sampler_abs_diff']:.2e} | {r['replayed/sampler_abs_diff']:.2e} |")


if __name__ == "__main__":
    main()
