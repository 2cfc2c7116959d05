"""The stub demo trained with LoRA adapters against a full fine-tune, one run each, one after the other.

    .venv/bin/python benchmarks/lora.py                          # 2 processes, 400 steps, rank 16
    .venv/bin/python benchmarks/lora.py --rank 16 --lora-lr 5e-4 --steps 400 --png lora.png

Both runs are the README demo (`--config-name stub`, seed 42, 16 prompts x 8 responses) with
`trainer.test_freq=--test-freq`; the LoRA run adds `actor.lora.rank=--rank actor.lora.alpha=--alpha
actor.lr=--lora-lr`. Reported per run: the greedy test reward at step 0 and at the end (the gain), the
training seconds (sum of `time/step_s`, evaluation excluded) to the first evaluation >= `--target`,
seconds per step, the update's and the weight push's seconds per step, and the trainable parameters.
"""
from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from pathlib import Path

from stub_runs import first_at, plot_curves, run_stub, test_curve


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lora-lr", type=float, default=5e-4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--test-freq", type=int, default=25)
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--only", choices=["full", "lora"], default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    common = [f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.test_freq}", f"trainer.seed={args.seed}"]
    runs = {"full fine-tune": common,
            f"LoRA r={args.rank}": [*common, f"actor.lora.rank={args.rank}", f"actor.lora.alpha={args.alpha:g}",
                                    f"actor.lr={args.lora_lr:g}"]}
    if args.only:
        runs = {k: v for k, v in runs.items() if (k.startswith("LoRA")) == (args.only == "lora")}
    curves, table = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in runs.items():
            save = Path(tmp) / re.sub(r"\W+", "_", name)
            rows = run_stub(save, overrides, args.nproc, args.timeout, name)
            curve = curves[name] = test_curve(rows)
            hit = first_at(curve, args.target)
            steps = [r for r in rows if r["step"] > 0]
            table.append((name, curve[0][2], curve[-1][2], hit, curve[-1][1] / max(len(steps), 1),
                          mean_of(steps, "time/update_s"), mean_of(steps, "time/weight_sync_s")))
            print(f"{name}: " + ", ".join(f"{s}: {r:.3f}" for s, _, r in curve), flush=True)
    print(f"\nstub demo, {args.nproc} processes, {args.steps} steps, seed {args.seed}; LoRA rank {args.rank}, "
          f"alpha {args.alpha:g}, lr {args.lora_lr:g} (full fine-tune: the stub config's lr)")
    print(f"| run | test reward start -> end | gain | training s to {args.target} | s / step | update s / step "
          "| push s / step |")
    print("|---|---|---|---|---|---|---|")
    for name, first, last, hit, per_step, update, push in table:
        reach = f"{hit[1]:.1f} (step {hit[0]})" if hit else "not reached"
        print(f"| {name} | {first:.3f} -> {last:.3f} | {last - first:+.3f} | {reach} | {per_step:.3f} | "
              f"{update:.3f} | {push:.4f} |")
    if args.png:
        plot_curves(curves, args.target, args.png)


if __name__ == "__main__":
    main()
