"""Does a refactor change the numbers? Train the same short runs on two commits and compare their
`metrics.jsonl` row by row, every key except timings, bit for bit.

    .venv/bin/python benchmarks/same_numbers.py --base 865f534            # base vs the work tree
    .venv/bin/python benchmarks/same_numbers.py --base 865f534 --steps 20 --runs demo ppo
    .venv/bin/python benchmarks/same_numbers.py --base 865f534 --nproc 1 --runs demo bf16_kl bf16_ppo
    .venv/bin/python benchmarks/same_numbers.py --base 865f534 --new-keys actor/sampler_kl_lag actor/tokens_share_lag

The base commit is checked out with `git worktree` into a temporary folder and run with this
checkout's `.venv`, so both sides share the machine and the libraries: float roundings depend on
the CPU, so recorded files from another machine would differ for reasons that are not the code.
Exit status 0 when every run matches, 1 otherwise (the first differing keys are printed per run).
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

# The runs the layering refactor (issue 34) must leave unchanged: the demo, PPO with a critic, one-step-off
# prefetch, and a dedicated rollout rank; and bf16 with a KL reference, and bf16 PPO (the precision paths:
# fp32 masters on one process, `--nproc 1`, and a frozen reference held in bf16). On CPU processes (`--nproc`,
# 2 by default) from the stub config.
BF16 = ["actor.dtype=bfloat16", "rollout.dtype=bfloat16", "actor.kl.coef=0.1"]
RUNS: dict[str, list[str]] = {
    "demo": [],
    "ppo": ["algorithm=ppo"],
    "stale1": ["rollout.max_staleness=1"],
    "rollout_rank": ["rollout.ranks=1"],
    "bf16_kl": BF16,
    "bf16_ppo": ["algorithm=ppo", "critic.dtype=bfloat16", *BF16],
}

# Keys that measure time, speed or memory: they differ between any two runs of the same code. Matched on
# the key's last part (`time/...` aside), so `actor/optimizer_steps` or `async/staleness_max` still count.
TIMING_PARTS = ("mfu", "memory", "_mb", "_gb", "seconds", "throughput", "latency")


def is_timing(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return key.startswith("time/") or name.endswith("_s") or any(m in name for m in TIMING_PARTS)


def run(checkout: Path, save: Path, overrides: list[str], steps: int, python: str, nproc: int = 2) -> list[dict]:
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "train.trainer.grpo",
           "--config-name", "stub", f"trainer.save_dir={save}", "trainer.progress_bar=false",
           f"trainer.total_steps={steps}", f"trainer.test_freq={max(1, steps // 2)}", *overrides]
    proc = subprocess.run(cmd, cwd=checkout, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"run in {checkout} ({' '.join(overrides) or 'demo'}) failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


def differences(base: list[dict], new: list[dict], limit: int = 10, new_keys: tuple[str, ...] = ()) -> list[str]:
    """Human-readable differences between two metrics files, timing keys ignored (and keys that only the new run
    has, when they start with one of `new_keys`: metrics a change adds)."""
    out = []
    if len(base) != len(new):
        out.append(f"{len(base)} rows in the base, {len(new)} now")
    for i, (a, b) in enumerate(zip(base, new)):
        keys = {k for k in a.keys() | b.keys() if not is_timing(k)
                and not (k not in a and k.startswith(new_keys) and new_keys)}
        for k in sorted(keys):
            if k not in a or k not in b:
                out.append(f"row {i} (step {a.get('step')}): key {k!r} only in the {'base' if k in a else 'new'} run")
            elif a[k] != b[k]:
                out.append(f"row {i} (step {a.get('step')}): {k} = {a[k]!r} in the base, {b[k]!r} now")
            if len(out) >= limit:
                return out
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to compare against (e.g. main before a refactor)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2, help="processes per run (rollout_rank needs 2)")
    p.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    p.add_argument("--keep", help="keep the runs in this folder (default: a temporary one, removed)")
    p.add_argument("--new-keys", nargs="+", default=[], help="metric prefixes the change adds (only in the new run)")
    args = p.parse_args(argv)
    python = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable
    with tempfile.TemporaryDirectory(prefix="same_numbers_") as tmp:
        work = Path(args.keep or tmp)
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base], cwd=REPO, check=True,
                       capture_output=True)
        try:
            failed = 0
            for name in args.runs:
                a = run(base_tree, work / f"base_{name}", RUNS[name], args.steps, python, args.nproc)
                b = run(REPO, work / f"new_{name}", RUNS[name], args.steps, python, args.nproc)
                diff = differences(a, b, new_keys=tuple(args.new_keys))
                compared = sum(1 for r in a for k in r if not is_timing(k))
                print(f"{name:13s} {'identical' if not diff else 'DIFFERENT'}: {len(a)} rows, {compared} values compared"
                      + "".join(f"\n    {d}" for d in diff))
                failed += bool(diff)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, capture_output=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
