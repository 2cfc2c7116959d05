"""The actor update's fixed cost, counted: ops dispatched and host syncs per phase of one update.

    .venv/bin/python benchmarks/update_ops.py                   # CPU, ~1 minute; --device cuda on a GPU

On one GPU a small model's update is bound by the host launching kernels, not by the GPU running them (the H100
run of 2026-11-25: 8k and 16k tokens took the same 0.52 s at Qwen2.5-0.5B). Every aten op the host dispatches is
at least one kernel launch there (a foreach op is one multi-tensor kernel), and every read of a device value
(`.item()`, `float(tensor)`) stops the host until the GPU has caught up. Both can be counted on a CPU: this builds
a random model with Qwen2.5-0.5B's tensor layout (24 layers, 290 tensors, tied embeddings) at tiny widths, so the
count is the real one and the arithmetic is negligible, and runs the actor's update as on one GPU (bf16 compute:
bf16 weights with fp32 masters, the trainer's default, or with `--master-weights false` FSDP2's mixed precision
over one rank; gradient checkpointing, every pack recomputing unless `--recompute-above`, one packed
micro-batch unless `--packs`). It prints, per
phase, the ops dispatched (a `TorchDispatchMode` count: what the Python dispatcher sees, so a CPU foreach op
that loops internally still counts once), the host syncs among them, and the median seconds over `--repeats`
updates.

Phases: `forward` (the model's forward and its log-prob head, with FSDP's unshard), `backward` (FSDP's
unshard again, the checkpointed recompute, the gradient reduction, or the masters' gradient sums), `weight norms`
(the update's weight-change metric, before and after), `clip` (the global gradient norm and scaling), `optimizer`
(AdamW, zero_grad, the masters' cast into the bf16 weights), and `other`: the loss and its metrics, packing, the
metrics' reduction.
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from train.models import optim, trainable  # noqa: E402
from train.models.actor import Actor  # noqa: E402
from train.models.master_weights import MasterWeights  # noqa: E402
from train.parallel.distributed import init_distributed  # noqa: E402
from train.parallel.step_batch import dispatch, exchange_index  # noqa: E402

PHASES = ("forward", "backward", "weight norms", "clip", "optimizer", "other")


class Counter(TorchDispatchMode):
    """Ops and host syncs dispatched, by the phase the update is in."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "other"
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.phase] += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs[self.phase] += 1
        return func(*args, **(kwargs or {}))


class Phases:
    """Wraps the functions the update calls so that ops and seconds are booked to their phase."""

    def __init__(self) -> None:
        self.current = "other"
        self.counter: Counter | None = None
        self.seconds: collections.Counter = collections.Counter()

    def enter(self, phase: str):
        outer, self.current = self.current, phase
        if self.counter is not None:
            self.counter.phase = phase
        return outer

    def leave(self, outer: str) -> None:
        self.current = outer
        if self.counter is not None:
            self.counter.phase = outer

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def booked(*a, **kw):
            outer = self.enter(phase)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if outer == "other":  # a phase inside another is booked to the outer one
                    self.seconds[phase] += time.perf_counter() - start
                self.leave(outer)

        setattr(owner, name, booked)


def build(args, folder: Path):
    shapes = gpu_suite.Shapes(args.hidden, args.layers, 4, 2, 2 * args.hidden, 512, (4,), 8, 8, (args.tokens,), 2, 2, 8)
    gpu_suite.write_model(shapes, folder)
    ctx = init_distributed()
    cfg = OmegaConf.load(ROOT / "config" / "grpo.yaml").actor
    cfg.model_name = str(folder)
    cfg.max_length_per_device = -(-args.tokens // args.packs)
    cfg.dtype = args.dtype
    cfg.gradient_checkpointing = True
    cfg.use_liger_kernel = False
    cfg.compile = args.compile
    cfg.master_weights = {"null": None, "true": True, "false": False}[args.master_weights]
    torch.manual_seed(0)
    actor = Actor(cfg, ctx, str(folder), pad_token_id=0, train=True, temperature=1.0, total_updates=1000)
    actor.recompute_above = args.recompute_above  # what a GPU's plan sets (memory_plan.recompute_above)
    ids, masks, adv, sampler, max_new = gpu_suite.fixed_batch(args.tokens, shapes.vocab)
    index = exchange_index([len(x) for x in ids], list(range(len(ids))), [0.0] * len(ids), ctx.device)
    batch = dispatch(index, ids, masks, sampler, actor.layout, 1, ctx.device)
    batch.fields["advantages"] = [adv[g] * m for g, m in zip(batch.members, batch.mask)]
    return actor, batch, max_new


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B: 24)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (tiny: the count, not the arithmetic)")
    p.add_argument("--tokens", type=int, default=512, help="tokens in the update's batch (8 samples)")
    p.add_argument("--packs", type=int, default=1, help="packed micro-batches they are split into")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16: FSDP2 mixed precision over one rank, as on a GPU")
    p.add_argument("--compile", action="store_true", help="actor.compile: each decoder layer compiled")
    p.add_argument("--master-weights", default="null", choices=("null", "true", "false"),
                   help="actor.master_weights: true = bf16 weights and fp32 masters (null: the trainer's default, true "
                        "here), false = FSDP2's mixed precision over one rank")
    p.add_argument("--recompute-above", type=int, default=None,
                   help="packs of at most this many tokens skip the checkpointed recompute (default: every pack "
                        "recomputes; a GPU's null actor.gradient_checkpointing sets it from free memory)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    phases = Phases()
    phases.wrap(trainable.Trainable, "local_weight_square", "weight norms")
    phases.wrap(optim, "clip_grad_norm", "clip")
    phases.wrap(torch.optim.AdamW, "step", "optimizer")
    phases.wrap(torch.optim.Optimizer, "zero_grad", "optimizer")
    phases.wrap(torch.Tensor, "backward", "backward")
    phases.wrap(Actor, "_forward", "forward")
    phases.wrap(MasterWeights, "collect", "backward")
    phases.wrap(MasterWeights, "publish", "optimizer")
    with tempfile.TemporaryDirectory() as tmp:
        actor, batch, max_new = build(args, Path(tmp))
        for _ in range(3 if args.compile else 1):  # warm-up: the optimizer's state, caches, compiled graphs
            actor.update(batch, max_new)
        totals = []
        per_phase: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(args.repeats):
            phases.seconds.clear()
            start = time.perf_counter()
            actor.update(batch, max_new)
            totals.append(time.perf_counter() - start)
            booked = sum(v for k, v in phases.seconds.items() if k != "other")
            phases.seconds["other"] = totals[-1] - booked
            for phase in PHASES:
                per_phase[phase].append(phases.seconds.get(phase, 0.0))
        counter = Counter()
        phases.counter = counter
        with counter:
            actor.update(batch, max_new)
        phases.counter = None
    params = sum(1 for _ in actor.model.parameters())
    recompute = ("every pack recomputes" if args.recompute_above is None else
                 f"packs over {args.recompute_above} tokens recompute")
    print(f"{args.layers} layers, {params} tensors, {args.tokens} tokens in {args.packs} pack(s) ({recompute}), {args.dtype}, "
          f"model {type(actor.model).__name__}{', compiled layers' if args.compile else ''}"
          f"{', fp32 masters (actor.master_weights)' if actor.masters is not None else ''}")
    print(f"| phase | ops | host syncs | ms (median of {args.repeats}) |\n|---|---|---|---|")
    for phase in PHASES:
        print(f"| {phase} | {counter.ops[phase]:,} | {counter.syncs[phase]} | "
              f"{statistics.median(per_phase[phase]) * 1e3:.1f} |")
    print(f"| **update** | **{sum(counter.ops.values()):,}** | **{sum(counter.syncs.values())}** | "
          f"**{statistics.median(totals) * 1e3:.1f}** |")
    if args.compile:
        print("(ops are counted with the layers running eagerly: dynamo does not run compiled code under a Python "
              "dispatch mode; the seconds are the compiled ones)")


if __name__ == "__main__":
    main()
