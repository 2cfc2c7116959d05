"""What the stub-demo benchmarks share (async_env.py, async_learning.py, curriculum.py, distill.py, vs_trl.py):
one trainer run as a subprocess, the greedy test-reward curve of its metrics, the seconds to a
target reward, and a PNG of test reward against training seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

Curve = list[tuple[int, float, float]]  # (step, training seconds so far, greedy test reward)


def run_stub(save: Path, overrides: list[str], nproc: int, timeout: int, name: str) -> list[dict]:
    """`torchrun -m train.trainer.grpo --config-name stub` into `save`; its metrics.jsonl rows. A
    failed run stops the benchmark with its stderr (`name` says which run)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "train.trainer.grpo", "--config-name", "stub", f"trainer.save_dir={save}",
           "trainer.progress_bar=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


def test_curve(rows: list[dict]) -> Curve:
    """Every evaluation (step 0 included) with the training seconds before it (evaluation excluded)."""
    out, seconds = [], 0.0
    for r in rows:
        seconds += r.get("time/step_s", 0.0)
        if "rewards/test" in r:
            out.append((r["step"], seconds, r["rewards/test"]))
    return out


def first_at(curve: Curve, target: float) -> tuple[int, float] | None:
    """(step, training seconds) of the first evaluation at or above `target`, or None."""
    return next(((step, seconds) for step, seconds, reward in curve if reward >= target), None)


def plot_curves(curves: dict[str, Curve], target: float, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        ax.plot([p[1] for p in curve], [p[2] for p in curve], marker="o", label=label)
    ax.axhline(target, color="grey", linestyle=":")
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("greedy test reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")
