"""Does one-step-off training learn as fast per step, and per second? The stub demo, synchronous
against `rollout.max_staleness=1`, one run each, on this machine.

    .venv/bin/python benchmarks/async_learning.py                       # 2 ranks, 300 steps, eval every 25
    .venv/bin/python benchmarks/async_learning.py --nproc 1 --target 0.6 --png runs/async_learning.png

Reported per run: the greedy test reward (256 test rows) every `--test-freq` steps, the first step
at which it reaches `--target`, and the training seconds until then (the sum of `time/step_s`,
evaluation excluded). A PNG of test reward against training seconds when `--png` is given.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(args, save: Path, staleness: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "train.trainer.grpo", "--config-name", "stub", f"trainer.save_dir={save}",
           f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.test_freq}", "trainer.progress_bar=false",
           f"rollout.max_staleness={staleness}", f"trainer.seed={args.seed}"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"max_staleness={staleness} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


def curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, training seconds so far, test reward) at every evaluation (step 0 included)."""
    out, seconds = [], 0.0
    for r in rows:
        seconds += r.get("time/step_s", 0.0)
        if "rewards/test" in r:
            out.append((r["step"], seconds, r["rewards/test"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--test-freq", type=int, default=25)
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in (0, 1):
            curves[staleness] = curve(run(args, Path(tmp) / f"s{staleness}", staleness))
    print(f"stub demo, {args.nproc} rank(s), seed {args.seed}, greedy test reward every {args.test_freq} steps")
    print("| max_staleness | step s (mean) | first step >= target | training s to target | final test reward |")
    print("|---|---|---|---|---|")
    for staleness, points in curves.items():
        hit = next(((s, sec) for s, sec, r in points if r >= args.target), None)
        mean_step = points[-1][1] / max(points[-1][0], 1)
        print(f"| {staleness} | {mean_step:.3f} | {hit[0] if hit else 'not reached'} | "
              f"{f'{hit[1]:.1f}' if hit else '-'} | {points[-1][2]:.3f} |")
    print("curves (step, training s, test reward):", json.dumps(curves))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for staleness, points in curves.items():
            ax.plot([p[1] for p in points], [p[2] for p in points], marker="o",
                    label=f"max_staleness={staleness}")
        ax.axhline(args.target, color="grey", linestyle=":")
        ax.set_xlabel("training seconds (evaluation excluded)")
        ax.set_ylabel("greedy test reward")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
