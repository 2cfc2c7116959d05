"""On-policy distillation on the stub demo: a student (the untrained stub) learns from a teacher (the
stub after the README demo's 400 GRPO steps), beside GRPO on the task reward alone, same steps, same seed.

    .venv/bin/python benchmarks/distill.py                           # trains the teacher first (~2.5 min)
    .venv/bin/python benchmarks/distill.py --teacher runs/stub/latest --steps 100 --png distill.png

The teacher is any exported model (`<save_dir>/latest` of a finished run). Reported: the greedy test
reward (256 held-out sums) every `--test-freq` steps for the distilled student (`algorithm=distill`:
the advantage of every token is -(log pi_student - log pi_teacher), no task reward) and for GRPO
(the default config: the task reward only), the teacher's own test reward, and the per-token reverse
KL to the teacher over the distilled run. Both students start from the same weights and seed.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from stub_runs import plot_curves, run_stub, test_curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", help="an exported model folder (default: train one, the README demo's 400 steps)")
    p.add_argument("--teacher-steps", type=int, default=400)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--test-freq", type=int, default=25)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--png", help="write the two curves (test reward against training seconds) here")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="distill-"))
    teacher = args.teacher
    if teacher is None:
        rows = run_stub(work / "teacher", [f"trainer.total_steps={args.teacher_steps}", "trainer.test_freq=null",
                                           f"trainer.seed={args.seed}"], args.nproc, args.timeout, "the teacher")
        teacher = str(work / "teacher" / "latest")
        print(f"teacher: {args.teacher_steps} GRPO steps, train reward (last 20) "
              f"{statistics.mean(r['rewards/train'] for r in rows[-20:]):.3f}", flush=True)
    common = [f"trainer.total_steps={args.steps}", f"trainer.test_freq={args.test_freq}", f"trainer.seed={args.seed}"]
    # the teacher's own greedy test reward: its step-0 evaluation as a student that never trains
    judged = run_stub(work / "teacher_eval", [f"actor.model_name={teacher}", "trainer.total_steps=1",
                                              "trainer.test_freq=1", "actor.freeze_steps=1"],
                      args.nproc, args.timeout, "the teacher's evaluation")
    teacher_reward = next(r["rewards/test"] for r in judged if "rewards/test" in r)
    runs = {
        "distilled (algorithm=distill)": run_stub(work / "distill", [*common, "algorithm=distill",
                                                                     f"distill.teacher={teacher}"],
                                                  args.nproc, args.timeout, "distillation"),
        "GRPO (task reward)": run_stub(work / "grpo", common, args.nproc, args.timeout, "GRPO"),
    }
    curves = {name: test_curve(rows) for name, rows in runs.items()}
    steps = [step for step, _, _ in next(iter(curves.values()))]
    print(f"\nteacher {teacher}: greedy test reward {teacher_reward:.3f}\n")
    print("| student | " + " | ".join(f"step {s}" for s in steps) + " | s/step |")
    print("|---|" + "---|" * (len(steps) + 1))
    for name, curve in curves.items():
        per_step = statistics.median(r["time/step_s"] for r in runs[name] if "time/step_s" in r)
        print(f"| {name} | " + " | ".join(f"{reward:.3f}" for _, _, reward in curve) + f" | {per_step:.2f} |")
    rkl = [r["distill/reverse_kl"] for r in runs["distilled (algorithm=distill)"] if "distill/reverse_kl" in r]
    tenth = max(1, len(rkl) // 10)
    print(f"\nreverse KL to the teacher per token: first {tenth} steps {statistics.mean(rkl[:tenth]):.3f}, "
          f"last {tenth} steps {statistics.mean(rkl[-tenth:]):.3f}")
    if args.png:
        plot_curves(curves, teacher_reward, args.png)


if __name__ == "__main__":
    main()
