"""Which prompts to roll out: `data.curriculum.policy` uniform, skip_saturated and prioritized on
the stub demo, one run each, one after the other, on this machine.

    .venv/bin/python benchmarks/curriculum.py                     # 1 process, 300 steps, 800 training rows
    .venv/bin/python benchmarks/curriculum.py --rows 5000         # the whole stub set (one epoch: no revisits)

A policy can only act on prompts it has seen, so the training set is cut to `--rows` prompts (800:
50 steps per epoch, 6 epochs in 300 steps). Reported per policy: the greedy test reward (256 test
rows) every `--test-freq` steps, the training seconds (sum of `time/step_s`, evaluation excluded)
to the first evaluation >= `--target`, the final test reward, the share of groups whose rewards were
all equal (what dynamic filtering throws away: rollouts spent for nothing) and the candidates the
policy skipped.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from stub_runs import REPO, first_at, run_stub, test_curve

POLICIES = ("uniform", "skip_saturated", "prioritized")


def run(args, work: Path, policy: str, data: Path) -> list[dict]:
    return run_stub(work / policy, [f"data.train_data_path={data}", f"trainer.total_steps={args.steps}",
                                    f"trainer.test_freq={args.test_freq}", f"data.curriculum.policy={policy}",
                                    f"trainer.seed={args.seed}"], args.nproc, args.timeout, policy)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=800)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--test-freq", type=int, default=25)
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "train.jsonl"
        lines = (REPO / "stub" / "data" / "math" / "train.jsonl").read_text().splitlines()[: args.rows]
        data.write_text("\n".join(lines) + "\n")
        for policy in args.policies:
            rows = run(args, work, policy, data)
            curve = [(step, round(seconds, 1), reward) for step, seconds, reward in test_curve(rows)]
            trained = [r for r in rows if "time/step_s" in r]
            seconds = sum(r["time/step_s"] for r in trained)
            hit = first_at(curve, args.target)
            results[policy] = {
                "curve": curve, "target_step": hit[0] if hit else None, "target_s": hit[1] if hit else None,
                "final": curve[-1][2], "step_s": seconds / max(len(trained), 1),
                "uniform_groups": sum(r.get("dynamic_filtering_ratio", 0.0) for r in trained) / max(len(trained), 1),
                "skipped": sum(r.get("curriculum/skipped", 0.0) for r in trained),
            }
    print(f"stub, {args.rows} training rows, {args.nproc} process(es), seed {args.seed}, {args.steps} steps; "
          f"greedy test reward every {args.test_freq} steps, target {args.target}")
    print("| policy | step s | first evaluation >= target | training s to it | final test reward | "
          "uniform groups | candidates skipped |")
    print("|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        print(f"| {policy} | {r['step_s']:.3f} | {r['target_step'] or 'not reached'} | "
              f"{r['target_s'] if r['target_s'] is not None else '-'} | {r['final']:.3f} | "
              f"{100 * r['uniform_groups']:.0f}% | {r['skipped']:.0f} |")
    print("curves (step, training s, test reward):", json.dumps({k: v["curve"] for k, v in results.items()}))


if __name__ == "__main__":
    main()
