#!/usr/bin/env python
"""Per-step NDCG, search, crop and completion rates of a visual search run, from its trajectories.jsonl.

    .venv/bin/python environments/visual_search_curves.py runs/visual_search_stub [--window 5]
    .venv/bin/python -m train.utils.plot runs/visual_search_stub/visual_search.jsonl \
        --keys visual_search/ndcg visual_search/search_rate visual_search/crop_rate rewards/train

The trainer logs the env's API calls (api/image_search/*, api/crop/*, ...) but not NDCG (the env's
`pop_reward_stats` has no trainer hook). This reads the sampled conversations of every step (set
`trainer.log_samples` to at least the samples per rank, as config/visual_search_stub.yaml does, or the
figures are those of the logged ones) and recomputes what environments/visual_search.py scored:

  visual_search/ndcg             NDCG@VSEARCH_NDCG_K (default 3) as the reward uses it: 0 without
                                 <search_complete>true</search_complete> (VSEARCH_REQUIRE_COMPLETE=1)
  visual_search/ndcg_completed   the same over the completed episodes only
  visual_search/search_rate      episodes with at least one search reply (slides shown)
  visual_search/crop_rate        episodes with at least one crop shown (a valid <bbox>)
  visual_search/complete_rate    episodes whose last turn is <search_complete>true</search_complete>
  visual_search/samples          episodes read

It writes them, one line per step with the step's api/image_search/count, api/crop/count, api/crop/errors,
rewards/train and rewards/test from metrics.jsonl, to RUN/visual_search.jsonl, and prints the first and
last steps and the means of the first and last `--window` steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # judge_ndcg, visual_search

from judge_ndcg import gold_ids, ndcg_at_k, retrieved_ids  # noqa: E402
from visual_search import completed, id_view  # noqa: E402

METRICS = ("rewards/train", "rewards/test", "api/image_search/count", "api/crop/count", "api/crop/errors",
           "tools/call_rate", "time/step_s")
RATES = ("ndcg", "ndcg_completed", "search_rate", "crop_rate", "complete_rate")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def episode(messages: list[dict], answer: object, k: int) -> dict[str, float]:
    tools = [m for m in messages if m.get("role") == "tool"]
    done = completed(messages)
    ndcg = ndcg_at_k(retrieved_ids(id_view(messages)), gold_ids(answer), k)
    return {"ndcg": ndcg if done else 0.0, "completed": float(done),
            "searched": float(any(m.get("doc_ids") for m in tools)),
            "cropped": float(any("crop_of" in m for m in tools)), "ndcg_if_done": ndcg}


def curves(run: Path, k: int = 3) -> list[dict]:
    """One record per step: the rates above and the step's metrics."""
    by_step: dict[int, list[dict]] = {}
    for e in read_jsonl(run / "trajectories.jsonl"):
        if e.get("type") == "sample":
            by_step.setdefault(int(e["step"]), []).append(episode(e["messages"], e.get("answer"), k))
    metrics = {int(m["step"]): m for m in read_jsonl(run / "metrics.jsonl")} if (run / "metrics.jsonl").exists() else {}
    out = []
    for step in sorted(set(by_step) | {s for s, m in metrics.items() if "rewards/test" in m}):
        if step not in by_step:  # an evaluation without a training step (step 0): its test reward alone
            out.append({"step": step, "rewards/test": metrics[step]["rewards/test"]})
            continue
        eps = by_step[step]
        n, done = len(eps), [e for e in eps if e["completed"]]
        record = {"step": step, "visual_search/samples": n,
                  "visual_search/ndcg": sum(e["ndcg"] for e in eps) / n,
                  "visual_search/ndcg_completed": sum(e["ndcg_if_done"] for e in done) / len(done) if done else 0.0,
                  "visual_search/search_rate": sum(e["searched"] for e in eps) / n,
                  "visual_search/crop_rate": sum(e["cropped"] for e in eps) / n,
                  "visual_search/complete_rate": len(done) / n}
        record.update({key: metrics[step][key] for key in METRICS if key in metrics.get(step, {})})
        out.append(record)
    return out


def mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="the run folder (trainer.save_dir)")
    parser.add_argument("--window", type=int, default=5, help="steps averaged at the start and the end")
    parser.add_argument("--k", type=int, default=int(os.environ.get("VSEARCH_NDCG_K", "3")), help="NDCG cut-off")
    args = parser.parse_args(argv)
    run = Path(args.run)
    records = curves(run, args.k)
    trained = [r for r in records if "visual_search/samples" in r]
    if not trained:
        print(f"{run / 'trajectories.jsonl'}: no sample events", file=sys.stderr)
        return 1
    with open(run / "visual_search.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    keys = [f"visual_search/{k}" for k in RATES] + ["api/image_search/count", "api/crop/count", "rewards/train"]
    w = max(1, min(args.window, len(trained)))
    first, last = trained[0], trained[-1]
    print(f"{run / 'visual_search.jsonl'}: {len(trained)} steps, {first['visual_search/samples']} samples "
          f"in step {first['step']}")
    print(f"{'':28} {'step ' + str(first['step']):>10} {'step ' + str(last['step']):>10} "
          f"{'first ' + str(w):>10} {'last ' + str(w):>10}")
    for key in keys:
        print(f"{key:28} {first.get(key, float('nan')):10.3f} {last.get(key, float('nan')):10.3f} "
              f"{mean(trained[:w], key):10.3f} {mean(trained[-w:], key):10.3f}")
    tests = [(r["step"], r["rewards/test"]) for r in records if "rewards/test" in r]
    if tests:
        print("rewards/test (greedy): " + ", ".join(f"step {s}: {v:.3f}" for s, v in tests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
