"""Training passes with and without a group's prompt laid out once (actor.share_prompt), one process.

    .venv/bin/python benchmarks/shared_prompt.py                       # stub (G=8) and SmolLM2-135M (300-token prompt)
    .venv/bin/python benchmarks/shared_prompt.py --cases stub --repeats 5

For each case the actor is built as the trainer builds it (`config/grpo.yaml`'s `actor` section, one
rank), a synthetic rollout batch is dispatched twice, with `share_prompt` off and on, and the two
passes every step runs are timed on each, alternating off/on `--repeats` times (so a drift of the
machine's speed hits both alike): the no-grad pass (`compute_logprobs`: old and reference
log-probs, values) and the update (`actor.update`: forward, backward, optimizer step). Each case
reports the median seconds of each pass, the ratio off/on, and the tokens laid out per token held.

Cases: `stub`: the stub model, the stub demo's shapes (14-token prompt, ~6-token replies, 16 prompts
x 8). `smollm2`: SmolLM2-135M (prepared offline by scripts/prepare_smollm2.py), a 300-token
system prompt plus question (~320 tokens), ~64-token replies, 2 prompts x 8.
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
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from parallel_layouts import synthetic_batch  # noqa: E402

CASES = {  # name: (model folder, prompts, responses, prompt tokens, reply tokens)
    "stub": ("stub/model", 16, 8, 14, 6),
    "smollm2": (".cache/smollm2-135m-instruct", 2, 8, 320, 64),
}


def run_case(name: str, ctx, repeats: int) -> dict:
    from train.models.actor import Actor
    from train.parallel.step_batch import dispatch, exchange_index

    folder, prompts, responses, prompt_len, reply_len = CASES[name]
    path = REPO / folder
    if not path.is_dir():
        return {"case": name, "skipped": f"{path} missing (run scripts/prepare_smollm2.py)"}
    cfg = OmegaConf.load(REPO / "config" / "grpo.yaml").actor
    cfg.model_name, cfg.lr, cfg.max_length_per_device = str(path), 1e-6, 8192
    actor = Actor(cfg, ctx, str(path), pad_token_id=0, train=True, temperature=1.0, total_updates=10 * repeats)
    vocab = int(actor.model.config.vocab_size)
    ids, masks, adv, sampler, max_new = synthetic_batch(prompts, responses, prompt_len, reply_len, vocab)
    groups = [i // responses for i in range(len(ids))]
    index = exchange_index([len(x) for x in ids], groups, [0.0] * len(ids), ctx.device)
    batches = {}
    for share in (False, True):
        sb = dispatch(index, ids, masks, sampler, actor.layout, 1, ctx.device, share_prompt=share)
        sb.fields["advantages"] = [a * m for a, m in zip((adv[g] for g in sb.members), sb.mask)]
        batches[share] = sb
    times = {(share, kind): [] for share in (False, True) for kind in ("no_grad", "update")}
    ratio = 1.0
    for r in range(repeats + 1):  # the first round warms up
        for share in (False, True):
            sb = batches[share]
            start = time.perf_counter()
            actor.compute_logprobs(sb)
            mid = time.perf_counter()
            metrics = actor.update(sb, max_new)
            end = time.perf_counter()
            if r:
                times[(share, "no_grad")].append(mid - start)
                times[(share, "update")].append(end - mid)
            if share:
                ratio = metrics["actor/tokens_computed_ratio"]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"case": name, "samples": len(ids), "tokens": sum(len(x) for x in ids), "laid_out_ratio": ratio,
            **{f"{kind}_{'shared' if share else 'unshared'}_s": v for (share, kind), v in med.items()},
            "no_grad_speedup": med[(False, "no_grad")] / med[(True, "no_grad")],
            "update_speedup": med[(False, "update")] / med[(True, "update")]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="stub,smollm2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from train.parallel.distributed import cleanup, init_distributed

    ctx = init_distributed()
    try:
        print(f"# shared_prompt.py on {platform.processor() or platform.machine()}, {args.threads} threads, "
              f"torch {torch.__version__}")
        print("| case | samples | tokens | laid out / held | no-grad pass off / on (s) | speed-up | update off / on (s) "
              "| speed-up |")
        print("|---|---|---|---|---|---|---|---|")
        for name in args.cases.split(","):
            row = run_case(name, ctx, args.repeats)
            if "skipped" in row:
                print(f"| {name} | skipped: {row['skipped']} |")
                continue
            print(f"| {name} | {row['samples']} | {row['tokens']} | {row['laid_out_ratio']:.2f} | "
                  f"{row['no_grad_unshared_s']:.3f} / {row['no_grad_shared_s']:.3f} | {row['no_grad_speedup']:.2f}x | "
                  f"{row['update_unshared_s']:.3f} / {row['update_shared_s']:.3f} | {row['update_speedup']:.2f}x |",
                  flush=True)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
