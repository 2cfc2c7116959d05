"""Every algorithm of the set on the stub math task, through the real CLI, one after the other.

    .venv/bin/python benchmarks/algorithms.py                    # all 16 rows, 100 steps each, 2 ranks
    .venv/bin/python benchmarks/algorithms.py --steps 60 --only grpo ppo
    .venv/bin/python benchmarks/algorithms.py --markdown         # the table as markdown (docs/algorithms.md)
    .venv/bin/python benchmarks/algorithms.py --seeds 3 --markdown   # 3 seeds each: mean +- std of the gain

Each run is `torchrun --nproc_per_node=N -m train.trainer.grpo --config-name stub algorithm=<name>
trainer.total_steps=S trainer.test_freq=S`: greedy test reward on the 256 held-out sums before
training (step 0) and after the last step, with the preset's published settings and the stub's
learning rate. The table shows both, the change, the mean train reward over the last 20 steps,
the time per step and the run's wall time. A run "learns" if its last test reward beats the first.
With --seeds K each preset runs with seeds --seed, --seed+1, ...: the table then gives each column's
mean over the seeds, the gain as mean +- sample standard deviation, and every seed's gain.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALGORITHMS = {  # name -> (preset, extra overrides)
    "GRPO": ("grpo", []),
    "Dr. GRPO": ("dr_grpo", []),
    "DAPO": ("dapo", []),
    "GSPO": ("gspo", []),
    "CISPO": ("cispo", []),
    "RLOO": ("rloo", []),
    "REINFORCE++": ("reinforce_pp", []),
    "PPO+GAE": ("ppo", []),
    # masked IS needs a sampler that differs from the trainer: one step off, the samples are a version old
    "GRPO 1-off + MIS": ("grpo", ["rollout.max_staleness=1", "actor.mis_level=token"]),
    # the losses verl 0.9.1 also registers (actor.loss): over two passes per rollout, where a loss's trust region
    # acts (on one pass every ratio is 1 and most of them are the plain policy gradient); GRPO the same way beside
    "GRPO 2 passes": ("grpo", ["actor.update_per_rollout=2"]),
    "SAPO": ("grpo", ["actor.loss=sapo", "actor.agg_mode=seq_mean_token_mean", "actor.update_per_rollout=2"]),
    "DPPO-TV": ("grpo", ["actor.loss=dppo_tv", "actor.update_per_rollout=2"]),
    "DPPO-KL": ("grpo", ["actor.loss=dppo_kl", "actor.update_per_rollout=2"]),
    "DRO": ("grpo", ["actor.loss=dro", "actor.dro_beta=0.1", "actor.update_per_rollout=2"]),
    "Clip-Cov": ("grpo", ["actor.loss=clip_cov", "actor.update_per_rollout=2"]),
    "KL-Cov": ("grpo", ["actor.loss=kl_cov", "actor.update_per_rollout=2"]),
}


def slug(name: str) -> str:
    """A row's name as --only takes it and its folder is named: 'DPPO-TV' -> 'dppo_tv'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run_one(preset: str, extra: list[str], steps: int, nproc: int, out: Path, seed: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           "-m", "train.trainer.grpo", "--config-name", "stub", f"algorithm={preset}",
           f"trainer.total_steps={steps}", f"trainer.test_freq={steps}", f"trainer.save_dir={out}",
           f"trainer.seed={seed}", "trainer.progress_bar=false", "trainer.log_samples=0", *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{preset} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    tests = [(m["step"], m["rewards/test"]) for m in rows if "rewards/test" in m]
    train = [m["rewards/train"] for m in rows if "rewards/train" in m]
    step_s = [m["time/step_s"] for m in rows if "time/step_s" in m]
    return {"first": tests[0][1], "last": tests[-1][1], "train_last20": statistics.mean(train[-20:]),
            "step_s": statistics.median(step_s), "wall_s": wall, "command": " ".join(cmd[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--seeds", type=int, default=1, help="runs per preset, seeds --seed, --seed+1, ...")
    parser.add_argument("--only", nargs="*", help="presets to run (grpo dr_grpo dapo gspo cispo rloo reinforce_pp ppo; "
                        "a preset runs every row built on it) or rows by name (sapo dppo_tv grpo_2_passes ...)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides added to every chosen run (a variant: --only cispo --set actor.update_per_rollout=1)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--keep", help="folder for the runs (default: a temporary one)")
    args = parser.parse_args()

    chosen = {k: v for k, v in ALGORITHMS.items() if not args.only or v[0] in args.only or slug(k) in args.only}
    seeds = [args.seed + k for k in range(args.seeds)]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="algos-"))
    results: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    for seed in seeds:  # seed-major: a slow drift of the machine's speed spreads over every preset
        for name, (preset, extra) in chosen.items():
            folder = f"{slug(name)}-seed{seed}"  # one folder per row of the table
            r = run_one(preset, [*extra, *args.set], args.steps, args.nproc, root / folder, seed)
            results.setdefault(name, []).append(r)
            print(f"{name:12s} seed {seed} test {r['first']:.3f} -> {r['last']:.3f} ({r['last'] - r['first']:+.3f})  "
                  f"{r['step_s']:.2f} s/step  {r['wall_s']:.0f} s", flush=True)
    total = time.perf_counter() - t0

    def mean(runs: list[dict], key: str) -> float:
        return statistics.mean(r[key] for r in runs)

    header = ["algorithm", "preset", "test reward, step 0", f"step {args.steps}", "change",
              "train reward (last 20 steps)", "s/step", "wall s"]
    if len(seeds) > 1:
        header[4] = f"change, mean ± std ({len(seeds)} seeds)"
        header.insert(5, "change per seed")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, runs in results.items():
        gains = [r["last"] - r["first"] for r in runs]
        change = f"{statistics.mean(gains):+.3f}"
        preset, extra = chosen[name]
        cells = [name, f"`{' '.join([f'algorithm={preset}', *extra, *args.set])}`", f"{mean(runs, 'first'):.3f}",
                 f"{mean(runs, 'last'):.3f}", change]
        if len(seeds) > 1:
            cells[4] = f"{change} ± {statistics.stdev(gains):.3f}"
            cells.append(", ".join(f"{g:+.3f}" for g in gains))
        cells += [f"{mean(runs, 'train_last20'):.3f}", f"{mean(runs, 'step_s'):.2f}", f"{mean(runs, 'wall_s'):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    print()
    print("\n".join(lines) if args.markdown else "\n".join(line.replace("|", " ") for line in lines[:1] + lines[2:]))
    learned = sum(statistics.mean(r["last"] - r["first"] for r in runs) > 0 for runs in results.values())
    print(f"\n{len(results)} presets x {len(seeds)} seed(s) ({', '.join(map(str, seeds))}), {args.steps} steps each, "
          f"{args.nproc} ranks, {total / 60:.1f} min in all; mean gain positive: {learned}/{len(results)}")

if __name__ == "__main__":
    main()
