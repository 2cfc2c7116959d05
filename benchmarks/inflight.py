"""In-flight rollouts against synchronous and one-step-off ones, side by side in one run, on a long-tailed and slow
environment: most replies short, one prompt in eight answered over 8 turns (8x longer), and every env call (each
tool turn and the reward: a sandbox, a judge) waiting a fixed latency.

    .venv/bin/python benchmarks/inflight.py                          # throughput: 0 / 100 / 200 ms, 30 steps each
    .venv/bin/python benchmarks/inflight.py --learn --steps 300      # + training seconds to test reward 0.6
    .venv/bin/python benchmarks/inflight.py --modes sync inflight2 --latency-ms 200 --nproc 1 --rollout-ranks 0

Modes: `sync` (rollout.max_staleness=0), `offstep` (max_staleness=1: the next rollout during the update, the push
waiting for its generation), `inflightK` (rollout.inflight=true, max_staleness=K: one segment of max_new_tokens x
max_turns / K tokens per step, K x prompts_per_rollout groups in flight), `continuousK` (the same with
rollout.inflight_mode=continuous: segments back to back, env calls running on across them). Default layout:
1 trainer rank + 1 dedicated rollout rank (`--nproc 2 --rollout-ranks 1`).

Per run: samples trained per second (prompts x responses / median step time after `--warmup`), the step's
phases, and with several latencies the share of the environment's time hidden: 1 - (env cost of the mode) /
(env cost of sync), where env cost = step time at that latency - step time at 0 ms. With `--learn`: the greedy
test reward every `--test-freq` steps and the training seconds (sum of time/step_s) until it reaches `--target`,
and the sampler-trainer KL per version gap (actor/sampler_kl_lag{j}, token-weighted over the run). One run at a
time, nothing else running.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from stub_runs import REPO, first_at, run_stub, test_curve

LONG_TAIL_ENV = '''
import asyncio, hashlib, importlib.util
_spec = importlib.util.spec_from_file_location("eq_env", {eq!r})
_eq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_eq)


def _long(messages) -> bool:  # one prompt in eight, the same every run
    return hashlib.sha256(str(messages[0]["content"]).encode()).digest()[0] % 8 == 0


async def interact(messages):
    turns = sum(m["role"] == "assistant" for m in messages)
    if not _long(messages) or turns >= 8:
        return []
    await asyncio.sleep({latency_s!r})  # a tool call's round trip
    return [{{"role": "user", "content": "Show your work again."}}]


async def reward_fn(messages, answer):
    await asyncio.sleep({latency_s!r})  # a remote judge / sandbox round trip
    first = next(m for m in messages if m["role"] == "assistant")  # the answer; later turns only make it long
    return _eq.reward_fn([*messages[:1], first], answer)
'''

MODES = {"sync": ["rollout.max_staleness=0"], "offstep": ["rollout.max_staleness=1"],
         **{f"inflight{k}": ["rollout.inflight=true", f"rollout.max_staleness={k}"] for k in (1, 2, 4)},
         **{f"continuous{k}": ["rollout.inflight=true", "rollout.inflight_mode=continuous",
                               f"rollout.max_staleness={k}"] for k in (1, 2, 4)}}


def env_file(work: Path, latency_ms: float) -> str:
    path = work / f"long_tail_{latency_ms:g}ms.py"
    path.write_text(LONG_TAIL_ENV.format(eq=str(REPO / "environments" / "eq.py"), latency_s=latency_ms / 1000))
    return str(path)


def run(args, work: Path, mode: str, latency_ms: float, steps: int, test_freq: int | None) -> list[dict]:
    name = f"{mode}_{latency_ms:g}ms" + ("_learn" if test_freq else "")
    return run_stub(work / name, [f"trainer.total_steps={steps}", f"trainer.test_freq={test_freq or 'null'}",
                                  f"rollout.env_path={env_file(work, latency_ms)}", "rollout.max_turns=8",
                                  "rollout.max_total_length=512", f"rollout.ranks={args.rollout_ranks}",
                                  "rollout.dynamic_filtering=false",  # every step trains 16 x 8 samples
                                  f"trainer.seed={args.seed}", *MODES[mode]],
                    args.nproc, args.timeout, name)


def throughput(args, rows: list[dict]) -> dict:
    rows = rows[args.warmup:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    per_step = 16 * 8  # the stub demo's prompts x responses
    return {"step_s": med("time/step_s"), "samples_per_s": per_step / med("time/step_s"),
            "rollout_s": med("time/rollout_s"), "update_s": med("time/update_s"),
            "push_s": med("time/weight_sync_s"), "trainer_wait_s": med("async/trainer_wait_s"),
            "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in rows),
            "spanning_share": statistics.mean(r.get("async/spanning_share", 0.0) for r in rows)}


def kl_by_gap(rows: list[dict]) -> dict[int, float]:
    """Token-weighted sampler-trainer KL per version gap over the run."""
    sums: dict[int, list[float]] = {}
    for r in rows:
        for j in range(5):
            share = r.get(f"actor/tokens_share_lag{j}")
            if share:
                acc = sums.setdefault(j, [0.0, 0.0])
                acc[0] += share * r[f"actor/sampler_kl_lag{j}"]
                acc[1] += share
    return {j: kl / weight for j, (kl, weight) in sorted(sums.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["sync", "offstep", "inflight2", "inflight4", "continuous2",
                                                  "continuous4"], choices=list(MODES))
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 100.0, 200.0])
    p.add_argument("--nproc", type=int, default=2, help="processes in all (trainer ranks + rollout ranks)")
    p.add_argument("--rollout-ranks", type=int, default=1)
    p.add_argument("--steps", type=int, default=30, help="steps per throughput run")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--learn", action="store_true", help="also train each mode to --target (at the first latency)")
    p.add_argument("--learn-steps", type=int, default=300)
    p.add_argument("--test-freq", type=int, default=25)
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results: dict = {"throughput": {}, "learn": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode in args.modes:
            for latency in args.latency_ms:
                got = throughput(args, run(args, work, mode, latency, args.steps, None))
                results["throughput"][f"{mode} {latency:g}"] = got
                print(mode, f"{latency:g} ms", json.dumps({k: round(v, 4) for k, v in got.items()}), flush=True)
            if args.learn:
                rows = run(args, work, mode, args.latency_ms[0], args.learn_steps, args.test_freq)
                curve = test_curve(rows)
                steps = [r["time/step_s"] for r in rows if "time/step_s" in r]  # (step 0: an evaluation only)
                results["learn"][mode] = {"curve": curve, "hit": first_at(curve, args.target),
                                          "step_s": statistics.mean(steps), "kl_by_gap": kl_by_gap(rows)}
                print(mode, "learn", json.dumps(results["learn"][mode]["hit"]), flush=True)
    layout = f"{args.nproc - args.rollout_ranks} trainer rank(s) + {args.rollout_ranks} rollout rank(s)"
    print(f"\nlong-tailed env (1 prompt in 8 answered over 8 turns), {layout}, median step of steps "
          f"{args.warmup + 1}-{args.steps}")
    lat = args.latency_ms
    print("| mode | " + " | ".join(f"samples/s at {x:g} ms" for x in lat) + " | " +
          " | ".join(f"env hidden at {x:g} ms" for x in lat if x > 0) + " |")
    print("|---" * (1 + len(lat) + sum(x > 0 for x in lat)) + "|")
    tp = results["throughput"]
    for mode in args.modes:
        cells = [f"{tp[f'{mode} {x:g}']['samples_per_s']:.0f}" for x in lat]
        hidden = []
        for x in lat:
            if x <= 0:
                continue
            if 0 in lat and "sync" in args.modes:
                sync_cost = tp[f"sync {x:g}"]["step_s"] - tp["sync 0"]["step_s"]
                cost = tp[f"{mode} {x:g}"]["step_s"] - tp[f"{mode} 0"]["step_s"]
                hidden.append(f"{1 - cost / sync_cost:.0%}" if sync_cost > 0 else "-")
            else:
                hidden.append("-")
        print(f"| {mode} | " + " | ".join(cells + hidden) + " |")
    if args.learn:
        print(f"\nlearning at {lat[0]:g} ms: greedy test reward every {args.test_freq} steps, target {args.target}")
        print("| mode | step s (mean) | first step >= target | training s to it | final test reward | "
              "sampler KL by version gap |")
        print("|---|---|---|---|---|---|")
        for mode, r in results["learn"].items():
            hit, curve = r["hit"], r["curve"]
            gaps = ", ".join(f"{j}: {kl:.2g}" for j, kl in r["kl_by_gap"].items())
            print(f"| {mode} | {r['step_s']:.3f} | {hit[0] if hit else 'not reached'} | "
                  f"{f'{hit[1]:.1f}' if hit else '-'} | {curve[-1][2]:.3f} | {gaps} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
