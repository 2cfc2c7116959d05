"""Evaluate a model folder (an exported `latest/`, a step's export, a peft adapter folder, any local HF model) on a
dataset with an environment module, outside training:

    .venv/bin/python -m train.eval runs/stub/latest --data stub/data/math/test.jsonl --env environments/eq.py \
        --max-new-tokens 12 [--samples 8 --k 1 4 8 --temperature 1.0] [--out eval.json]

It reports the greedy reward (one reply per row at temperature 0, as the trainer's `rewards/test`), and with
`--samples n` the sampled mean reward and pass@k for each `--k` (a row passes when a reply's reward is at least
`--success`, default 1.0). pass@k is the unbiased estimator of Chen et al. (2021) from n samples per row:
1 - C(n - c, k) / C(n, k), with c the row's passing samples, averaged over rows; per data source too.
Rows, chat templates, multi-turn episodes and env errors are handled as in training (the same rollout worker).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from train.algorithms.pass_at_k import pass_at_k


def summarize(rewards_by_row: list[list[float]], sources: list[str | None], ks: list[int],
              success: float) -> dict[str, float]:
    """Mean reward and pass@k over rows (and per source when rows have several)."""
    out: dict[str, float] = {}
    groups: dict[str | None, list[int]] = defaultdict(list)
    for i, source in enumerate(sources):
        groups[None].append(i)
        if len(set(sources)) > 1:
            groups[source].append(i)
    for source, rows in groups.items():
        suffix = "" if source is None else f"/{source}"
        n = len(rewards_by_row[rows[0]])
        out[f"reward{suffix}"] = sum(sum(rewards_by_row[i]) / n for i in rows) / len(rows)
        for k in ks:
            out[f"pass@{k}{suffix}"] = sum(pass_at_k(n, sum(r >= success for r in rewards_by_row[i]), k)
                                           for i in rows) / len(rows)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a local model folder (exported latest/, a peft adapter folder, an HF model)")
    ap.add_argument("--data", required=True, help="rows as the trainer reads them (jsonl, json, csv, parquet, ...)")
    ap.add_argument("--env", required=True, help="the environment module (interact, reward_fn)")
    ap.add_argument("--samples", type=int, default=0, help="sampled replies per row for pass@k (0: greedy only)")
    ap.add_argument("--k", type=int, nargs="*", default=[1], help="pass@k for each k <= --samples")
    ap.add_argument("--temperature", type=float, default=1.0, help="of the sampled replies")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-turns", type=int, default=1)
    ap.add_argument("--max-total-length", type=int, default=None, help="context (default: the model's)")
    ap.add_argument("--success", type=float, default=1.0, help="a reply passes when its reward is at least this")
    ap.add_argument("--limit", type=int, default=None, help="the first N rows only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    if args.samples and any(not 1 <= k <= args.samples for k in args.k):
        ap.error(f"--k {args.k}: each k must be between 1 and --samples {args.samples}")

    from train.datasets.loading import load_rows
    from train.engines.base import SamplingParams
    from train.engines.hf import HFEngine
    from train.workers.environment import Environment
    from train.workers.rollout import UNUSABLE_PROMPTS, RolloutWorker

    rows = load_rows(args.data, args.limit)
    engine = HFEngine.from_pretrained(args.model)
    context = args.max_total_length or engine.max_positions or 4096
    env = Environment(args.env, timeout_s=600, max_workers=16, max_turns=args.max_turns, key="--env")
    worker = RolloutWorker(engine, env, engine.tokenizer, max_turns=args.max_turns, env_error_reward=0.0,
                           max_total_length=context)
    results: dict[str, float] = {}
    try:
        runs = [("greedy", 1, 0.0)] + ([("sampled", args.samples, args.temperature)] if args.samples else [])
        for name, n, temperature in runs:
            sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature)
            samples, seconds = worker.rollout(rows, n, sampling, base_seed=args.seed)
            usable = [i for i in range(len(rows)) if samples[i * n].finish_reason not in UNUSABLE_PROMPTS]
            rewards = [[samples[i * n + j].reward for j in range(n)] for i in usable]
            sources = [rows[i].get("source") for i in usable]
            part = summarize(rewards, sources, args.k if name == "sampled" else [1], args.success)
            results.update({f"{name}/{k}": v for k, v in part.items()})
            results[f"{name}/env_errors"] = float(sum(bool(s.env_error) for s in samples))
            results[f"{name}/seconds"] = seconds
            results[f"{name}/rows"] = float(len(usable))
    finally:
        worker.close()
        engine.close()
    for key, value in results.items():
        print(f"{key:28s} {value:.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "data": args.data, "env": args.env, **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
