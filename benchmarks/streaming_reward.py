"""How much judge time does streaming reward hide? Rollout wall time, same samples, three ways:

  gen      rewards cost nothing: the generation-only floor
  stream   the trainer's behaviour: each sample is judged the moment it finishes generating
  after    judging starts only when every sample has finished (this benchmark's barrier; the
           trainer has no such mode)

    .venv/bin/python benchmarks/streaming_reward.py                             # delay judge: 0.05 s/call, 8 in flight
    .venv/bin/python benchmarks/streaming_reward.py --judge-latency 0.5 --judge-concurrency 4
    .venv/bin/python benchmarks/streaming_reward.py --judge serve               # train.serve as the judge

hidden fraction = 1 - (stream - gen) / (after - gen): the share of the judge time that scoring
after generation adds to the rollout and streaming does not.

Judges: `delay` is an env whose reward_fn holds one of `--judge-concurrency` slots for exactly
`--judge-latency` seconds (an API judge of known latency). `serve` starts
`python -m train.serve --model <--judge-model>` on 127.0.0.1 and scores with environments/judge_ndcg.py
(JUDGE_COEF=1, NDCG_COEF=0, no retries; a tiny judge's unparseable replies count as errors, its time
is real). The policy is the hf engine over `--model` on the stub math prompts; `--max-batch-size`
below the number of samples splits generation into several engine batches. Note that the hf engine
returns a whole batch at once, so streaming overlaps judging with *later* batches (or turns), not
with rows of the same batch; with an unlimited, constant-latency judge there is nothing to hide in a
single turn (the last batch's judge calls are always exposed): the gain comes from the judge's limited
throughput being used while generation still runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from train.engines.base import SamplingParams  # noqa: E402
from train.engines.hf import HFEngine  # noqa: E402
from train.workers.env_routing import EnvRouter  # noqa: E402
from train.workers.environment import Environment  # noqa: E402
from train.workers.rollout import RolloutWorker  # noqa: E402

DELAY_ENV = '''
"""A judge of known latency: each reward holds one of JUDGE_CONCURRENCY slots for LATENCY seconds."""
import asyncio, os
from train.utils.api_stats import ApiCallRecorder

recorder = ApiCallRecorder()
pop_api_calls = recorder.pop
_limits = {}


async def reward_fn(messages, answer):
    latency = float(os.environ["BENCH_JUDGE_LATENCY_S"])
    if latency <= 0:
        return 0.0
    loop = asyncio.get_running_loop()
    limit = _limits.setdefault(loop, asyncio.Semaphore(int(os.environ["JUDGE_CONCURRENCY"])))
    async with recorder.call("judge", limit):
        await asyncio.sleep(latency)
    return 0.0
'''


class AfterAll:
    """Wraps an Environment: no reward starts until all `n` samples have asked for theirs."""

    def __init__(self, env: Environment, n: int):
        self.env, self.n = env, n
        self.waiting = 0
        self.ready: asyncio.Event | None = None

    async def interact(self, messages):
        return await self.env.interact(messages)

    async def reward(self, messages, answer):
        if self.ready is None:
            self.ready = asyncio.Event()
        self.waiting += 1
        if self.waiting == self.n:
            self.ready.set()
        await self.ready.wait()
        return await self.env.reward(messages, answer)

    def __getattr__(self, name):  # name, stuck_calls, pop_api_calls, close, ...: the wrapped env's
        return getattr(self.env, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_judge_server(model: str, log: Path, threads: int | None) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    extra = ["--threads", str(threads)] if threads else []
    proc = subprocess.Popen([sys.executable, "-m", "train.serve", "--model", model, "--port", str(port),
                             "--served-model-name", "judge", *extra], cwd=REPO, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"train.serve exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1"
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("train.serve did not come up in 300 s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="streaming reward vs scoring after all generation")
    p.add_argument("--judge", choices=["delay", "serve"], default="delay")
    p.add_argument("--judge-latency", type=float, default=0.05, help="delay judge: seconds per call")
    p.add_argument("--judge-concurrency", type=int, default=8, help="judge calls in flight at most")
    p.add_argument("--judge-model", default=str(REPO / "stub" / "model"), help="serve judge: model folder")
    p.add_argument("--model", default=str(REPO / "stub" / "model"), help="the policy")
    p.add_argument("--data", default=str(REPO / "stub" / "data" / "math" / "test.jsonl"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--responses", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=4, help="engine rows per batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="rounds of (gen, stream, after); medians reported")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the policy")
    p.add_argument("--judge-threads", type=int, default=None, help="serve judge: torch threads of train.serve")
    p.add_argument("--out", default=None, help="write the raw timings as JSON")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["JUDGE_CONCURRENCY"] = str(args.judge_concurrency)
    tmp = Path(tempfile.mkdtemp(prefix="streaming-reward-"))
    server = None
    if args.judge == "delay":
        env_path = tmp / "delay_judge.py"
        env_path.write_text(textwrap.dedent(DELAY_ENV))
        judged = {"BENCH_JUDGE_LATENCY_S": str(args.judge_latency)}
        floor = {"BENCH_JUDGE_LATENCY_S": "0"}
    else:
        server, url = start_judge_server(args.judge_model, tmp / "judge.log", args.judge_threads)
        env_path = REPO / "environments" / "judge_ndcg.py"
        os.environ.update(JUDGE_BASE_URL=url, JUDGE_MODEL="judge", JUDGE_MAX_RETRIES="0", NDCG_COEF="0",
                          JUDGE_RESPONSE_FORMAT="none", JUDGE_TIMEOUT_S="120")
        judged, floor = {"JUDGE_COEF": "1"}, {"JUDGE_COEF": "0"}  # coef 0: no judge call at all

    with open(args.data) as f:
        rows = [json.loads(line) for line in f][: args.prompts]
    tok = AutoTokenizer.from_pretrained(args.model)
    engine = HFEngine.from_pretrained(args.model, tok, max_batch_size=args.max_batch_size)
    env = Environment(str(env_path), timeout_s=600, max_workers=16, max_turns=1)
    n = len(rows) * args.responses
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    times: dict[str, list[float]] = {"gen": [], "stream": [], "after": []}
    judge_calls: dict[str, list[dict]] = {"stream": [], "after": []}
    worker = RolloutWorker(engine, env, tok, max_turns=1, env_error_reward=0.0, max_total_length=512)
    try:
        for r in range(args.repeats + 1):  # round 0 warms up (first forward passes, connections)
            for mode in ("gen", "stream", "after"):
                os.environ.update(floor if mode == "gen" else judged)
                worker.envs = EnvRouter.of(AfterAll(env, n) if mode == "after" else env)
                samples, seconds = worker.rollout(rows, args.responses, sampling, base_seed=1000 + r)
                calls = env.pop_api_calls()
                if r == 0:
                    continue
                times[mode].append(seconds)
                if mode != "gen":
                    judge_calls[mode] += calls
                print(f"round {r} {mode:6s} {seconds:6.3f}s  ({sum(bool(s.env_error) for s in samples)} env errors, "
                      f"{len(calls)} judge calls)", flush=True)
    finally:
        worker.envs = EnvRouter.of(env)
        worker.close()  # the engine and the env too
        if server is not None:
            server.terminate()
            server.wait(30)

    med = {m: statistics.median(v) for m, v in times.items()}
    exposed_stream, exposed_after = med["stream"] - med["gen"], med["after"] - med["gen"]
    hidden = 1 - exposed_stream / exposed_after if exposed_after > 0 else float("nan")
    lat = sorted(c["latency_s"] for c in judge_calls["stream"])
    judge_busy = sum(lat) / max(args.judge_concurrency, 1) / max(args.repeats, 1)
    print(f"\n{n} samples ({len(rows)} prompts x {args.responses}), engine batches of {args.max_batch_size}, "
          f"judge={args.judge} concurrency {args.judge_concurrency}"
          + (f" latency {args.judge_latency}s" if args.judge == "delay" else ""))
    print(f"median rollout wall time: gen {med['gen']:.3f}s | stream {med['stream']:.3f}s | after {med['after']:.3f}s")
    if lat:
        print(f"judge calls per rollout {len(lat) / args.repeats:.0f}, median latency {statistics.median(lat):.3f}s, "
              f"judge time / concurrency {judge_busy:.3f}s")
    print(f"judge time added to the rollout: after-all {exposed_after:.3f}s, streaming {exposed_stream:.3f}s "
          f"-> streaming hides {100 * hidden:.0f}% of it")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "times": times, "median": med, "hidden_fraction": hidden}, f, indent=1)


if __name__ == "__main__":
    main()
