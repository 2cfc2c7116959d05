"""Serve the Tinker API over this project's trainer:

    .venv/bin/python -m train.tinker_service --base-model stub=stub/model --port 8100 [--api-key tml-local]
    torchrun --nproc_per_node=N -m train.tinker_service --base-model NAME=PATH ...   # FSDP2 over N ranks

then point the official SDK at it: `tinker.ServiceClient(base_url="http://127.0.0.1:8100", api_key="tml-local")`
(or TINKER_BASE_URL / TINKER_API_KEY). Rank 0 serves HTTP and drives the other ranks. docs/tinker.md.
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_bases(values: list[str]) -> dict[str, str]:
    bases = {}
    for value in values:
        name, _, path = value.rpartition("=") if "=" in value else (os.path.basename(value.rstrip("/")), "", value)
        if not os.path.isfile(os.path.join(path, "config.json")):
            sys.exit(f"--base-model {value}: {path!r} is not a local HF model folder (no config.json)")
        bases[name] = os.path.abspath(path)
    return bases


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train.tinker_service", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-model", action="append", required=True, metavar="NAME=PATH",
                    help="a base model clients may train and sample, by the name they give (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--api-key", default=os.environ.get("TINKER_SERVICE_API_KEY"),
                    help="clients must send it (the SDK's api_key); unset: no check. The SDK wants a 'tml-' prefix")
    ap.add_argument("--root", default="runs/tinker_service", help="where checkpoints and sampler weights go")
    ap.add_argument("--request-timeout-s", type=float, default=600.0,
                    help="a training request that waited this long in its model's queue fails instead of running")
    ap.add_argument("--queue-limit", type=int, default=64, help="waiting requests per model before 429")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384,
                    help="a forward_backward runs its datums in micro-batches of at most this many padded tokens")
    ap.add_argument("--sample-gather-ms", type=float, default=10.0,
                    help="sampling requests go to the engine together once none came for this long (at most "
                         "100 ms), so requests sent together share one batch; 0: each at once")
    args = ap.parse_args(argv)
    bases = parse_bases(args.base_model)

    from train.parallel.distributed import cleanup, init_distributed
    from train.tinker_service.ranks import Operations, RankGroup, follow

    ctx = init_distributed()
    ops = Operations(ctx.device, ctx.mesh, args.micro_batch_tokens)
    try:
        if ctx.rank != 0:
            follow(ops)
            return
        import uvicorn

        from train.tinker_service.server import TinkerService, build_app

        ranks = RankGroup(ops)
        service = TinkerService(bases, ranks, args.root, api_key=args.api_key, device=ctx.device,
                                request_timeout_s=args.request_timeout_s, queue_limit=args.queue_limit,
                                sample_gather_s=args.sample_gather_ms / 1000)
        print(f"tinker service: {', '.join(f'{k}={v}' for k, v in bases.items())} on http://{args.host}:{args.port} "
              f"({ctx.world_size} rank(s))", flush=True)
        try:
            uvicorn.run(build_app(service), host=args.host, port=args.port, log_level="warning")
        finally:
            ranks.close()
            service.pool.close()
    finally:
        cleanup()


if __name__ == "__main__":
    main()
