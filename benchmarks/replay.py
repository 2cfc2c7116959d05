"""Prioritized replay (`data.replay.*`) on the stub demo, where successes are rare (the warm-started model's
sampled replies pass 12-15% of the time): steps and training seconds to a greedy test reward, without replay and
with each priority, over several seeds, one run after the other on this machine.

    .venv/bin/python benchmarks/replay.py                              # 3 seeds x (off, success, advantage)
    .venv/bin/python benchmarks/replay.py --seeds 1 --steps 100 --variants off success
    .venv/bin/python benchmarks/replay.py --task compact --steps 300 --target 0.2 --variants off success

`--task compact` trains and evaluates on the compact sums ("23+45", stub/data/compact), which the model solves far
more rarely at first (sampled replies pass ~3% of the time, against 12-15% on the default task).

Each run: 1 process, `--steps` steps, greedy test reward (256 rows) every `--test-freq` steps. Reported per
variant: the first evaluation at or above `--target` for each seed (step; "-" if never), its mean over the
seeds that reached it, the final test reward, seconds per step (replayed groups make the batch larger) and the
mean share of replayed groups in a step's batch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from stub_runs import first_at, run_stub, test_curve

VARIANTS = {
    "off": [],
    "success": ["data.replay.enable=true", "data.replay.priority=success"],
    "advantage": ["data.replay.enable=true", "data.replay.priority=advantage"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--test-freq", type=int, default=20)
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--task", choices=("math", "compact"), default="math", help="the stub data folder")
    p.add_argument("--share", type=float, default=0.25, help="data.replay.share of the replay variants")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--out", default=None, help="also write the results here as JSON")
    args = p.parse_args()
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for variant in args.variants:
                extra = VARIANTS[variant] + ([f"data.replay.share={args.share}"] if variant != "off" else [])
                data = [f"data.{split}_data_path=stub/data/{args.task}/{split}.jsonl" for split in ("train", "test")]
                rows = run_stub(Path(tmp) / f"{variant}{seed}",
                                [*data, f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
                                 f"trainer.seed={seed}", *extra], args.nproc, args.timeout, f"{variant}, seed {seed}")
                curve = [(step, round(seconds, 1), reward) for step, seconds, reward in test_curve(rows)]
                trained = [r for r in rows if "time/step_s" in r]
                hit = first_at(curve, args.target)
                results[variant].append({
                    "seed": seed, "curve": curve, "target_step": hit[0] if hit else None,
                    "target_s": hit[1] if hit else None, "final": curve[-1][2],
                    "step_s": sum(r["time/step_s"] for r in trained) / max(len(trained), 1),
                    "replay_share": sum(r.get("replay/share", 0.0) for r in trained) / max(len(trained), 1)})
                print(f"{variant} seed {seed}: target step {results[variant][-1]['target_step']}, "
                      f"final {curve[-1][2]:.3f}", flush=True)
    print(f"\nstub ({args.task}), {args.nproc} process(es), {args.steps} steps, greedy test reward every "
          f"{args.test_freq} steps, target {args.target}, seeds {args.seeds}, replay share {args.share}")
    print("| replay | first evaluation >= target, per seed | mean (seeds that reached it) | training s to it (mean) | "
          "final test reward (mean) | step s | replayed share of the batch |")
    print("|---|---|---|---|---|---|---|")
    for variant, runs in results.items():
        steps = [r["target_step"] for r in runs]
        reached = [r for r in runs if r["target_step"] is not None]
        mean_step = f"{statistics.mean(r['target_step'] for r in reached):.0f}" if reached else "-"
        mean_s = f"{statistics.mean(r['target_s'] for r in reached):.1f}" if reached else "-"
        print(f"| {variant} | {', '.join(str(s) if s is not None else '-' for s in steps)} | {mean_step} | {mean_s} | "
              f"{statistics.mean(r['final'] for r in runs):.3f} | {statistics.mean(r['step_s'] for r in runs):.3f} | "
              f"{100 * statistics.mean(r['replay_share'] for r in runs):.0f}% |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
