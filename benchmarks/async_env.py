"""How much of a slow environment's latency one-step-off rollouts hide, on this machine.

    .venv/bin/python benchmarks/async_env.py                    # stub, 2 ranks, 100 ms env, 20 steps
    .venv/bin/python benchmarks/async_env.py --latency-ms 50 200 --nproc 1
    .venv/bin/python benchmarks/async_env.py --rollout-ranks 1   # 1 trainer rank + 1 dedicated rollout rank

Four runs of the stub demo's shape (16 prompts x 8 responses, 12 new tokens): synchronous and
`rollout.max_staleness=1`, each with `environments/eq.py`'s reward as it is and with a copy whose
`reward_fn` first waits a fixed latency (an LLM judge, a sandbox: `asyncio.sleep`, so calls overlap
like real network calls do). The environment's cost in a step is the slow run's step time minus the
fast run's; the share the asynchronous pipeline hides is 1 - (its env cost) / (the synchronous env
cost). With `--rollout-ranks K`, every run has K dedicated rollout ranks among its `--nproc` processes
(`rollout.ranks=K`). Step times are medians over the steps after `--warmup`. One run at a time, nothing else
running; the numbers go to a markdown table (and `--out` JSON).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from stub_runs import REPO, run_stub

SLOW_ENV = '''
import asyncio, importlib.util
_spec = importlib.util.spec_from_file_location("eq_env", {eq!r})
_eq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_eq)

async def reward_fn(messages, answer):
    await asyncio.sleep({latency_s!r})  # a remote judge / sandbox round trip
    return _eq.reward_fn(messages, answer)
'''


def run(args, work: Path, name: str, env_path: str, staleness: int) -> dict:
    rows = run_stub(work / name, [f"trainer.total_steps={args.steps}", "trainer.test_freq=null",
                                  f"rollout.env_path={env_path}", f"rollout.max_staleness={staleness}",
                                  f"rollout.ranks={args.rollout_ranks}"],
                    args.nproc, args.timeout, name)[args.warmup:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    return {"step_s": med("time/step_s"), "rollout_s": med("time/rollout_s"), "update_s": med("time/update_s"),
            "trainer_wait_s": med("async/trainer_wait_s"), "reward": statistics.mean(r["rewards/train"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency-ms", type=float, nargs="+", default=[100.0])
    p.add_argument("--nproc", type=int, default=2, help="processes in all (trainer ranks + rollout ranks)")
    p.add_argument("--rollout-ranks", type=int, default=0, help="rollout.ranks: dedicated rollout processes")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        eq = str(REPO / "environments" / "eq.py")
        for staleness in (0, 1):
            results[("fast", staleness)] = run(args, work, f"fast{staleness}", eq, staleness)
        for ms in args.latency_ms:
            slow = work / f"slow_{ms:g}ms.py"
            slow.write_text(SLOW_ENV.format(eq=eq, latency_s=ms / 1000))
            for staleness in (0, 1):
                results[(f"{ms:g} ms", staleness)] = run(args, work, f"slow{ms:g}_{staleness}", str(slow), staleness)
    print(f"stub, {args.nproc} rank(s) ({args.rollout_ranks} of them rollout ranks), 16x8 samples, median step of steps {args.warmup + 1}-{args.steps}")
    print("| env | sync step s | async step s | async / sync | env cost sync s | env cost async s | hidden |")
    print("|---|---|---|---|---|---|---|")
    base0, base1 = results[("fast", 0)]["step_s"], results[("fast", 1)]["step_s"]
    for (env, staleness), r in results.items():
        if staleness:
            continue
        a = results[(env, 1)]
        cost0, cost1 = r["step_s"] - base0, a["step_s"] - base1
        hidden = f"{100 * (1 - cost1 / cost0):.0f}%" if env != "fast" and cost0 > 0 else "-"
        print(f"| {env} | {r['step_s']:.3f} | {a['step_s']:.3f} | {a['step_s'] / r['step_s']:.2f} | "
              f"{cost0:.3f} | {cost1:.3f} | {hidden} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({f"{k[0]}|{k[1]}": v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
