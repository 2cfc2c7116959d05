"""Continue training a model on a new task without forgetting the old one (docs/continual.md), on the stub:
the model warm-started on spaced two-digit sums ("23 + 45", the old task) trains on the same sums written
compactly ("23+45", `stub/data/compact`, the new task: its sampled replies pass ~3% of the time at first), with
both tasks' held-out rows evaluated (greedy) every `--test-freq` steps. One run per variant, one after the other:

    .venv/bin/python benchmarks/continual.py                       # 300 steps, 3 variants, docs/continual_curves.png
    .venv/bin/python benchmarks/continual.py --steps 100 --variants plain guarded --png /tmp/c.png

- `plain`: the new task's rows only, no safeguard.
- `gate`: the same, with the forgetting gate on the old task's held-out reward (`trainer.forgetting.action=rollback`,
  `max_drop` 0.1): an evaluation that fell further than that restores the last evaluation that passed.
- `guarded`: the gate, plus a quarter of each step's prompts from the old task's training rows (a mixture,
  `data.train_data_path={compact: weight 3, addition: weight 1}`) and prioritized replay of rare successes
  (`data.replay.enable=true`).

Prints each variant's curves (step: old, new), the lowest old-task reward after step 0, the final rewards and the
gate's rollbacks, and plots both tasks' curves side by side.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from stub_runs import REPO, run_stub

OLD, NEW = "stub/data/math", "stub/data/compact"
TEST = f"data.test_data_path={{addition:{OLD}/test.jsonl,compact:{NEW}/test.jsonl}}"
GATE = ["trainer.forgetting.watch=[rewards/test/addition]", "trainer.forgetting.max_drop=0.1",
        "trainer.forgetting.action=rollback"]
VARIANTS = {
    "plain": [f"data.train_data_path={NEW}/train.jsonl"],
    "gate": [f"data.train_data_path={NEW}/train.jsonl", *GATE],
    "guarded": [f"data.train_data_path={{compact:{{path:{NEW}/train.jsonl,weight:3}},"
                f"addition:{{path:{OLD}/train.jsonl,weight:1}}}}", "data.replay.enable=true", *GATE],
}


def curves(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, old task's greedy test reward, new task's) at every evaluation."""
    return [(r["step"], r["rewards/test/addition"], r["rewards/test/compact"]) for r in rows
            if "rewards/test/addition" in r]


def plot(results: dict[str, dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, k, title in ((axes[0], 1, "old task: spaced sums (held out)"), (axes[1], 2, "new task: compact sums")):
        for name, r in results.items():
            ax.plot([p[0] for p in r["curve"]], [p[k] for p in r["curve"]], marker="o", markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy test reward")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--test-freq", type=int, default=20)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--png", default=str(REPO / "docs" / "continual_curves.png"))
    p.add_argument("--out", default=None, help="also write the results here as JSON")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            rows = run_stub(Path(tmp) / name, [*VARIANTS[name], TEST, f"trainer.total_steps={args.steps}",
                                               f"trainer.test_freq={args.test_freq}", f"trainer.seed={args.seed}"],
                            args.nproc, args.timeout, name)
            curve = curves(rows)
            results[name] = {"curve": curve, "rollbacks": sum(r.get("forgetting/rollback", 0.0) for r in rows),
                             "lowest_old": min(c[1] for c in curve[1:]), "final_old": curve[-1][1],
                             "final_new": curve[-1][2]}
            print(f"{name}: " + ", ".join(f"{s}: {a:.3f}/{b:.3f}" for s, a, b in curve), flush=True)
    start = next(iter(results.values()))["curve"][0]
    print(f"\nstub, {args.steps} steps, seed {args.seed}, greedy test reward every {args.test_freq} steps "
          f"(step 0: old {start[1]:.3f}, new {start[2]:.3f})")
    print("| variant | old task: lowest after step 0 | old task: final | new task: final | gate rollbacks |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['lowest_old']:.3f} | {r['final_old']:.3f} | {r['final_new']:.3f} | "
              f"{r['rollbacks']:.0f} |")
    plot(results, args.png)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
