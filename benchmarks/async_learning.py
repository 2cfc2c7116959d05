"""Does training on stale rollouts learn as fast per step, and per second? The stub demo, synchronous
against `rollout.max_staleness=1` (and any other `--staleness`), one run each, on this machine.

    .venv/bin/python benchmarks/async_learning.py                       # 2 ranks, 300 steps, eval every 25
    .venv/bin/python benchmarks/async_learning.py --staleness 0 1 2     # also two versions old
    .venv/bin/python benchmarks/async_learning.py --nproc 1 --target 0.6 --png runs/async_learning.png

Reported per run: the greedy test reward (256 test rows) every `--test-freq` steps, the first step
at which it reaches `--target`, and the training seconds until then (the sum of `time/step_s`,
evaluation excluded). A PNG of test reward against training seconds when `--png` is given.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from stub_runs import first_at, plot_curves, run_stub, test_curve


def run(args, save: Path, staleness: int) -> list[dict]:
    return run_stub(save, [f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
                           f"rollout.max_staleness={staleness}", f"trainer.seed={args.seed}"],
                    args.nproc, args.timeout, f"max_staleness={staleness}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--test-freq", type=int, default=25)
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--png", default=None)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="rollout.max_staleness values to run")
    args = p.parse_args()
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in args.staleness:
            curves[staleness] = test_curve(run(args, Path(tmp) / f"s{staleness}", staleness))
    print(f"stub demo, {args.nproc} rank(s), seed {args.seed}, greedy test reward every {args.test_freq} steps")
    print("| max_staleness | step s (mean) | first step >= target | training s to target | final test reward |")
    print("|---|---|---|---|---|")
    for staleness, points in curves.items():
        hit = first_at(points, args.target)
        mean_step = points[-1][1] / max(points[-1][0], 1)
        print(f"| {staleness} | {mean_step:.3f} | {hit[0] if hit else 'not reached'} | "
              f"{f'{hit[1]:.1f}' if hit else '-'} | {points[-1][2]:.3f} |")
    print("curves (step, training s, test reward):", json.dumps(curves))
    if args.png:
        plot_curves({f"max_staleness={k}": v for k, v in curves.items()}, args.target, args.png)

if __name__ == "__main__":
    main()
