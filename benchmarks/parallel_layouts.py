"""Actor update step time and peak memory per rank, for each parallel layout (DP, FSDP, TP, SP and mixes).

    .venv/bin/python benchmarks/parallel_layouts.py                                  # stub + SmolLM2-135M, all layouts
    .venv/bin/python benchmarks/parallel_layouts.py --models stub --layouts 1,tp2,fsdp2xtp2 --steps 1 --warmup 0
    .venv/bin/python benchmarks/parallel_layouts.py --models smollm2 --prompts 2 --responses 2 --markdown out.md
    .venv/bin/python benchmarks/parallel_layouts.py --models long --layouts 1,cp2,cp4 --prompts 1 --responses 1 \\
        --prompt-len 64 --response-len 8192 --max-tokens 12000 --steps 1 --warmup 0     # ring attention, 8K tokens

Driver mode (the default) runs, for every model and layout, one
`python -m torch.distributed.run --standalone --nproc_per_node=W benchmarks/parallel_layouts.py --worker ...`
after the other (never two at a time). Each worker rank builds the actor exactly as the trainer does
(`config/grpo.yaml`'s `actor` section plus the layout keys `ddp_size`, `tp_size`, `sp_size`), takes its
share (samples r::world) of one fixed synthetic rollout batch, so every layout trains on the same data
from the same weights, runs `--warmup` untimed and `--steps` timed `actor.update` calls, and writes one
JSON file per rank. The driver prints one markdown table per model.

Per rank: mean seconds per `actor.update` over the timed steps; peak RSS over the whole process
(`getrusage(RUSAGE_SELF).ru_maxrss`: on CPU this includes loading the full model before it is
sharded), peak RSS during the update steps only (the kernel's high-water mark reset through
`/proc/self/clear_refs` after the actor is built; "n/a" where that is not allowed), and on CUDA
`torch.cuda.max_memory_allocated()` during the steps (peak statistics reset after the actor is built)
and over the whole run. The first update's loss and gradient norm are printed too: they must agree
across layouts (same data, same initial weights), which is a cheap check that the layout trains the
same thing.

Layouts whose sizes do not fit the world (`layout_sizes`) or the model (`check_model_fits`: heads or
vocabulary not divisible), or that need more GPUs than the machine has, are printed as
"skipped: <reason>"; a worker that fails is printed as "failed: <last error line>" (its full log is
kept in the run folder, whose path is then printed).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {
    "stub": os.path.join(ROOT, "stub", "model"),
    "smollm2": os.path.join(ROOT, ".cache", "smollm2-135m-instruct"),
    "long": None,  # built in code in the run folder: a small Llama with a 64K context (build_long_model)
}


def build_long_model(folder: str) -> str:
    """A random 2-layer Llama (hidden 256, 4 heads, 2 key/value heads, vocabulary 512, 64K positions) and the
    stub's tokenizer: long sequences whose memory is activations, not weights or logits."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in os.listdir(MODELS["stub"]):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(os.path.join(MODELS["stub"], name), os.path.join(folder, name))
    return folder

# name -> (world size, ddp_size, tp_size, sp_size, cp_size). fsdp = world / (ddp * tp); dp = world / (sp * cp * tp).
LAYOUTS = {
    "1": (1, 1, 1, 1, 1),
    "dp2": (2, 2, 1, 1, 1),  # full replica per rank (ddp_size=2: FSDP2 replicates over ddp, fsdp=1)
    "fsdp2": (2, 1, 1, 1, 1),  # parameters, gradients and optimizer state sharded over 2 ranks
    "tp2": (2, 1, 2, 1, 1),
    "sp2": (2, 1, 1, 2, 1),  # Ulysses: each packed sequence split over 2 ranks (sharded over fsdp=2 as well)
    "cp2": (2, 1, 1, 1, 2),  # ring attention: each packed sequence split zigzag over 2 ranks
    "cp4": (4, 1, 1, 1, 4),
    "cp2xtp2": (4, 1, 2, 1, 2),  # a ring per tp rank, over its heads
    "fsdp2xtp2": (4, 1, 2, 1, 1),
    "sp2xtp2": (4, 1, 2, 2, 1),
    # 3-way splits for the 135M model (9 heads, 3 key/value heads: 2-way tp/sp does not divide them)
    "tp3": (3, 1, 3, 1, 1),
    "sp3": (3, 1, 1, 3, 1),
}
TITLES = {
    "1": "1 process",
    "dp2": "dp=2 (ddp_size=2)",
    "fsdp2": "fsdp=2",
    "tp2": "tp=2",
    "sp2": "sp=2",
    "tp3": "tp=3",
    "sp3": "sp=3",
    "fsdp2xtp2": "fsdp=2 x tp=2",
    "sp2xtp2": "sp=2 x tp=2",
    "cp2": "cp=2 (ring)",
    "cp4": "cp=4 (ring)",
    "cp2xtp2": "cp=2 x tp=2",
}


def canonical_layout(name: str) -> str:
    key = re.sub(r"\s+", "", name.lower()).replace("*", "x").replace("×", "x").replace("_", "x").replace("=", "")
    if key in ("1", "single", "one"):
        return "1"
    if key not in LAYOUTS:
        raise SystemExit(f"unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
    return key


# ---------------------------------------------------------------------------------------------
# the synthetic rollout batch (the same on every rank and in every layout)
# ---------------------------------------------------------------------------------------------
def synthetic_batch(prompts: int, responses: int, prompt_len: int, response_len: int, vocab: int, seed: int = 1234):
    """`prompts` groups of `responses` samples; prompt and response lengths drawn within +-25% of the
    given lengths, token ids in [3, vocab), one group-normalised advantage per sample, zero sampler
    log-probs (one update per rollout: the old log-probs are the current ones). Returns the lists
    and max_new_tokens (the longest possible response)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def jitter(n: int) -> int:
        lo, hi = max(1, (3 * n) // 4), max(1, (5 * n + 3) // 4)
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    ids, masks, adv, sampler = [], [], [], []
    for _ in range(prompts):
        prompt = torch.randint(3, vocab, (jitter(prompt_len),), generator=g).tolist()
        rewards = torch.randn(responses, generator=g)
        group_adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6) if responses > 1 else rewards
        for j in range(responses):
            response = torch.randint(3, vocab, (jitter(response_len),), generator=g).tolist()
            seq = prompt + response
            ids.append(seq)
            masks.append([0] * len(prompt) + [1] * len(response))
            adv.append(float(group_adv[j]))
            sampler.append([0.0] * len(seq))  # one entry per token, as a rollout records them
    max_new_tokens = max(1, (5 * response_len + 3) // 4)
    return ids, masks, adv, sampler, max_new_tokens


# ---------------------------------------------------------------------------------------------
# worker (one rank under torchrun)
# ---------------------------------------------------------------------------------------------
def _proc_status_mib(field: str) -> float | None:
    """A memory field of /proc/self/status (`VmHWM`, `RssAnon`, ...) in MiB; None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _vm_hwm_mib() -> float | None:
    return _proc_status_mib("VmHWM")


class PrivatePeak:
    """Peak private (anonymous) memory of this process while the `with` block runs, sampled every
    `interval` s from /proc/self/status. ru_maxrss also counts the checkpoint's file pages that
    safetensors maps (page cache, shared by every rank of a node and reclaimable); RssAnon is what a
    rank itself holds, the memory that adds up per rank."""

    def __init__(self, interval: float = 0.002):
        import threading

        self.interval, self.peak_mib, self._stop = interval, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def current_mib() -> float:
        value = _proc_status_mib("RssAnon")
        return float("nan") if value is None else value

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, self.current_mib())
            self._stop.wait(self.interval)

    def __enter__(self) -> "PrivatePeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, self.current_mib())


def _reset_rss_peak() -> bool:
    """Reset the kernel's RSS high-water mark of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _parse_value(text: str):
    """`--set` values: YAML scalars (ints, floats, booleans, null), else the string itself."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def own_of(rank: int, world: int, n: int) -> list[int]:
    return list(range(n))[rank::world]


def worker(args) -> None:
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    from train.models.actor import Actor
    from train.parallel.distributed import cleanup, init_distributed
    from train.parallel.step_batch import dispatch, exchange_index

    torch.set_num_threads(args.threads)
    ctx = init_distributed()
    try:
        torch.manual_seed(args.seed)
        cfg = OmegaConf.load(os.path.join(ROOT, "config", "grpo.yaml")).actor
        cfg.model_name = args.model_path
        cfg.lr = args.lr
        cfg.max_length_per_device = args.max_tokens
        OmegaConf.update(cfg, "ddp_size", args.ddp)
        OmegaConf.update(cfg, "tp_size", args.tp)
        OmegaConf.update(cfg, "sp_size", args.sp)
        OmegaConf.update(cfg, "cp_size", args.cp)
        OmegaConf.update(cfg, "dtype", args.dtype)
        for item in args.set or []:
            key, _, value = item.partition("=")
            OmegaConf.update(cfg, key, _parse_value(value))

        vocab = AutoConfig.from_pretrained(args.model_path).vocab_size
        ids, masks, adv, sampler, max_new = synthetic_batch(args.prompts, args.responses, args.prompt_len,
                                                            args.response_len, vocab, seed=args.seed + 1234)
        own = list(range(len(ids)))[ctx.rank::ctx.world_size]

        total_updates = args.warmup + args.steps + 1
        t_build = time.perf_counter()
        with PrivatePeak() as private_build:
            actor = Actor(cfg, ctx, args.model_path, pad_token_id=0, train=True, temperature=1.0,
                          total_updates=max(total_updates, 100))
        build_s = time.perf_counter() - t_build
        # the trainer's path: every rank's own samples, dispatched once to the dp groups
        index = exchange_index([len(ids[i]) for i in own], list(range(len(own))), [0.0] * len(own), ctx.device)
        batch = dispatch(index, [ids[i] for i in own], [masks[i] for i in own], [sampler[i] for i in own],
                         actor.layout, cfg.mini_batches, ctx.device)
        by_global = {g: own_of(index.owner[g], ctx.world_size, len(ids))[index.local[g]] for g in range(index.size)}
        batch.fields["advantages"] = [adv[by_global[g]] * m for g, m in zip(batch.members, batch.mask)]
        cuda = ctx.device.type == "cuda"
        rss_build_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        hwm_reset = _reset_rss_peak()
        if cuda:
            torch.cuda.synchronize()
            gpu_build_mib = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()

        times, metrics = [], []
        for step in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = actor.update(batch, max_new)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            metrics.append({k: float(v) for k, v in m.items()})
            if step >= args.warmup:
                times.append(dt)

        rss_end_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        steps_hwm = _vm_hwm_mib() if hwm_reset else None
        io = checkpoint_timings(actor, ctx, args.out_dir) if args.checkpoint else {}
        record = {
            "rank": ctx.rank,
            "world": ctx.world_size,
            "device": str(ctx.device),
            "threads": torch.get_num_threads(),
            "layout": dict(zip(("ddp", "fsdp", "tp", "sp", "cp", "dp"),
                               (actor.layout.sizes.ddp, actor.layout.sizes.fsdp, actor.layout.sizes.tp,
                                actor.layout.sizes.sp, actor.layout.sizes.cp, actor.layout.sizes.dp))),
            "own_samples": len(own),
            "own_tokens": sum(len(ids[i]) for i in own),
            "build_s": build_s,
            "step_s": times,
            "step_s_mean": statistics.fmean(times) if times else None,
            # the whole process (model loading included); ru_maxrss is KiB on Linux
            "peak_rss_mib": max(rss_build_mib, rss_end_mib, _vm_hwm_mib() or 0.0),
            "peak_rss_build_mib": rss_build_mib,
            "peak_private_build_mib": private_build.peak_mib,
            # the update steps only (high-water mark reset after the actor was built)
            "peak_rss_steps_mib": steps_hwm,
            **io,
            "first_update": {k: metrics[0].get(k) for k in ("actor/loss", "actor/grad_norm")} if metrics else None,
            "metrics": metrics,
        }
        if cuda:
            record["gpu_peak_steps_mib"] = torch.cuda.max_memory_allocated() / 2**20
            record["gpu_peak_mib"] = max(gpu_build_mib, record["gpu_peak_steps_mib"])
        with open(os.path.join(args.out_dir, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(record, f, indent=1)
    finally:
        cleanup()


def checkpoint_timings(actor, ctx, out_dir: str) -> dict:
    """Seconds to save the actor's model and Adam state (sharded, sync), the step-loop stall of an
    asynchronous save and its time to completion, and the seconds to load it back."""
    import torch.distributed as dist

    from train.runtime.checkpoint import Checkpointer

    folder = os.path.join(out_dir, "ckpt") if ctx.is_main else None
    holder = [folder]
    dist.broadcast_object_list(holder, src=0)
    folder = holder[0]
    workers = {"actor": actor}
    sync = Checkpointer(folder, ctx)
    dist.barrier()
    start = time.perf_counter()
    path = sync.save(1, workers, {"step": 1}, {"rng": None})
    save_s = time.perf_counter() - start
    asynchronous = Checkpointer(folder, ctx, async_save=True)
    dist.barrier()
    start = time.perf_counter()
    asynchronous.save(2, workers, {"step": 2}, {"rng": None})
    stall_s = time.perf_counter() - start
    asynchronous.wait()
    async_total_s = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    sync.load(path, workers)
    load_s = time.perf_counter() - start
    sync.close()
    asynchronous.close()
    return {"save_s": save_s, "async_stall_s": stall_s, "async_total_s": async_total_s, "load_s": load_s}


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def skip_reason(model_path: str, world: int, ddp: int, tp: int, sp: int, cuda_devices: int, cp: int = 1) -> str | None:
    from transformers import AutoConfig

    from train.parallel.layout import LayoutError, check_model_fits, layout_sizes

    try:
        sizes = layout_sizes(world, ddp, tp, sp, cp=cp)
        check_model_fits(sizes, AutoConfig.from_pretrained(model_path))
    except LayoutError as e:
        return str(e)
    if cuda_devices and world > cuda_devices:
        return f"needs {world} GPUs, this machine has {cuda_devices}"
    return None


def last_error(log: str) -> str:
    """The most telling line of a failed torchrun log: the last exception line printed by a worker
    rank (`[rankN]: SomeError: ...`), else the last exception line, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    exc = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")
    ranked = [re.sub(r"^\[(default)?rank\d+\]:\s*", "", ln) for ln in lines if re.match(r"^\[(default)?rank\d+\]:", ln)]
    for group in (ranked, [ln for ln in lines if "ChildFailedError" not in ln]):
        for text in reversed(group):
            if exc.match(text):
                return text
    return lines[-1] if lines else "no output"


def _stop_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def run_layout(args, model: str, model_path: str, name: str, run_dir: str) -> dict:
    world, ddp, tp, sp, cp = LAYOUTS[name]
    out_dir = os.path.join(run_dir, f"{model}_{name}")
    os.makedirs(out_dir, exist_ok=True)
    threads = args.threads or max(1, args.cores // world)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           os.path.abspath(__file__), "--worker", "--model-path", model_path, "--out-dir", out_dir,
           "--ddp", str(ddp), "--tp", str(tp), "--sp", str(sp), "--cp", str(cp), "--threads", str(threads),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts),
           "--responses", str(args.responses), "--prompt-len", str(args.prompt_len),
           "--response-len", str(args.response_len), "--max-tokens", str(args.max_tokens),
           "--lr", str(args.lr), "--seed", str(args.seed), "--dtype", args.dtype]
    if args.checkpoint:
        cmd.append("--checkpoint")
    for item in args.set or []:
        cmd += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    print(f"[{model} {name}] {world} rank(s) x {threads} thread(s) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    log_path = os.path.join(out_dir, "log.txt")
    with open(log_path, "w") as log:
        # its own process group, so a timeout or Ctrl-C stops torchrun *and* its worker ranks
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
            _stop_group(proc)
        except BaseException:
            _stop_group(proc)
            raise
    wall = time.perf_counter() - t0
    with open(log_path) as f:
        log_text = f.read()
    ranks = []
    rank_of = lambda p: int(re.findall(r"\d+", os.path.basename(p))[0])  # noqa: E731
    for path in sorted(glob.glob(os.path.join(out_dir, "rank*.json")), key=rank_of):
        with open(path) as f:
            ranks.append(json.load(f))
    row = {"layout": name, "world": world, "threads": threads, "wall_s": wall, "rc": rc, "ranks": ranks,
           "command": shlex.join(cmd), "log": log_path}
    if rc != 0 or len(ranks) != world:
        reason = f"timed out after {args.timeout} s" if rc == "timeout" else last_error(log_text)
        row["failed"] = reason
        print(f"[{model} {name}] failed (rc={rc}, {wall:.1f} s): {reason}\n  log: {log_path}",
              file=sys.stderr, flush=True)
    else:
        print(f"[{model} {name}] done in {wall:.1f} s", file=sys.stderr, flush=True)
    return row


def fmt_list(values, digits: int = 0) -> str:
    return "[" + ", ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values) + "]"


def table(rows: list[dict], cuda: bool) -> str:
    head = ["layout", "ranks", "step s", "build peak private MiB per rank", "build peak RSS MiB per rank",
            "peak RSS MiB per rank",
            "RSS during steps MiB per rank"]
    if cuda:
        head += ["GPU peak MiB per rank (steps)", "GPU peak MiB per rank (whole run)"]
    checkpoints = any("save_s" in r for row in rows for r in row.get("ranks", []))
    if checkpoints:
        head += ["save s", "async save: stall / done s", "load s"]
    head += ["loss / grad norm (1st update)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        title = f"{TITLES[row['layout']]} (`{row['layout']}`)"
        if "skipped" in row or "failed" in row:
            what = f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['failed']}"
            cells = [title, str(row["world"]), what] + [""] * (len(head) - 3)
        else:
            ranks = row["ranks"]
            means = [r["step_s_mean"] for r in ranks if r["step_s_mean"] is not None]
            step = f"{statistics.fmean(means):.3f}" if means else "n/a (0 steps)"
            if len(means) > 1:
                step += f" ({min(means):.3f}-{max(means):.3f})"
            first = ranks[0].get("first_update") or {}
            check = (f"{first.get('actor/loss'):.5f} / {first.get('actor/grad_norm'):.5f}"
                     if first.get("actor/grad_norm") is not None else "n/a")
            cells = [title, str(row["world"]), step,
                     fmt_list([r["peak_private_build_mib"] for r in ranks]),
                     fmt_list([r["peak_rss_build_mib"] for r in ranks]),
                     fmt_list([r["peak_rss_mib"] for r in ranks]),
                     fmt_list([r["peak_rss_steps_mib"] for r in ranks])]
            if cuda:
                cells += [fmt_list([r.get("gpu_peak_steps_mib") for r in ranks]),
                          fmt_list([r.get("gpu_peak_mib") for r in ranks])]
            if checkpoints:
                slowest = {k: max(r.get(k, 0.0) for r in ranks) for k in ("save_s", "async_stall_s",
                                                                        "async_total_s", "load_s")}
                cells += [f"{slowest['save_s']:.2f}", f"{slowest['async_stall_s']:.2f} / {slowest['async_total_s']:.2f}",
                          f"{slowest['load_s']:.2f}"]
            cells.append(check)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stored_copy(model_path: str, dtype: str, out: str) -> str:
    """`model_path` saved again with its weights in `dtype` (the Hub stores most models in bfloat16;
    loading those into fp32 parameters is what costs memory at start-up)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(os.path.join(out, "config.json")):
        AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).save_pretrained(out)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    return out


def count_params(model_path: str) -> int | None:
    try:
        from safetensors import safe_open
    except ImportError:
        return None
    total = 0
    for path in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                size = 1
                for dim in f.get_slice(key).get_shape():
                    size *= int(dim)
                total += size
    return total or None


def driver(args) -> None:
    import torch

    interp = sys.executable
    if interp.startswith(ROOT + os.sep):
        interp = os.path.relpath(interp, ROOT)
    command = shlex.join([interp, os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:])
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out: list[str] = []

    def emit(text: str = "") -> None:
        print(text, flush=True)
        out.append(text)

    emit(f"Command: `{command}`")
    emit()
    device = (f"{cuda_devices} x {torch.cuda.get_device_name(0)}" if cuda_devices
              else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), gloo")
    emit(f"torch {torch.__version__}, {device}; {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}. "
         f"Threads per rank: {args.threads or f'max(1, {args.cores} // ranks)'}. "
         f"Batch: {args.prompts} prompts x {args.responses} responses, prompt ~{args.prompt_len} and response "
         f"~{args.response_len} tokens (+-25%), rank r owns samples r::ranks; max_length_per_device "
         f"{args.max_tokens}, dtype {args.dtype}; {args.warmup} warm-up + {args.steps} timed update step(s).")
    emit()

    layouts = [canonical_layout(x) for x in args.layouts.split(",") if x.strip()] if args.layouts else list(LAYOUTS)
    run_dir = args.out_dir or tempfile.mkdtemp(prefix="parallel_layouts_")
    os.makedirs(run_dir, exist_ok=True)
    results = {"command": command, "device": device, "models": {}}
    any_failed = False
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for model in models:
        if model not in MODELS and not os.path.isdir(model):
            raise SystemExit(f"unknown model {model!r}: use stub, smollm2, long or a local HF folder")
    for model in models:
        path = MODELS.get(model) or os.path.abspath(model)
        if model == "long":
            path = build_long_model(os.path.join(run_dir, "long_model"))
        if not os.path.isfile(os.path.join(path, "config.json")):
            emit(f"## {model}: skipped, {os.path.relpath(path, ROOT)} is missing "
                 f"(make it with `.venv/bin/python scripts/prepare_smollm2.py`)")
            emit()
            continue
        if args.stored_dtype:
            path = stored_copy(path, args.stored_dtype, os.path.join(run_dir, f"{model}_{args.stored_dtype}"))
        n = count_params(path)
        emit(f"## {model} (`{os.path.relpath(path, ROOT)}`{f', {n / 1e6:.1f}M parameters' if n else ''})")
        emit()
        rows = []
        for name in layouts:
            world, ddp, tp, sp, cp = LAYOUTS[name]
            reason = skip_reason(path, world, ddp, tp, sp, cuda_devices, cp)
            if reason:
                print(f"[{model} {name}] skipped: {reason}", file=sys.stderr, flush=True)
                rows.append({"layout": name, "world": world, "skipped": reason})
                continue
            row = run_layout(args, model, path, name, run_dir)
            any_failed |= "failed" in row
            rows.append(row)
        results["models"][model] = rows
        emit(table(rows, cuda_devices > 0))
        emit()
    emit("step s: mean over ranks of each rank's mean `actor.update` time (min-max over ranks in brackets). "
         "Build peak private: the process's anonymous memory (RssAnon, sampled every 2 ms) while the actor is "
         "built, the memory each rank holds on its own. Build peak RSS: ru_maxrss once the actor is built "
         "(imports and loading; it also counts the checkpoint's mapped file pages, page cache shared by the "
         "node's ranks). "
         "Peak RSS: whole process, model loading included (ru_maxrss). RSS during steps: high-water mark "
         "reset after the actor was built. Save / load: the slowest rank. The 1st-update loss / grad norm "
         "should agree across layouts.")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(out) + "\n")
        print(f"markdown written to {args.markdown}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"json written to {args.json}", file=sys.stderr)
    if args.keep or args.out_dir or any_failed:
        print(f"run folder (per-rank JSON, logs): {run_dir}", file=sys.stderr)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="stub,smollm2", help="comma list: stub, smollm2, long, or local HF folders")
    p.add_argument("--layouts", default=None, help=f"comma list of {', '.join(LAYOUTS)} (default: all)")
    p.add_argument("--steps", type=int, default=3, help="timed update steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed update steps first")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--responses", type=int, default=4, help="samples = prompts x responses (default 8)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=1024, help="actor.max_length_per_device")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", default="float32", help="actor.dtype (bfloat16 applies on CUDA only)")
    p.add_argument("--stored-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="build from a copy of each model saved in this dtype (Hub checkpoints are mostly bfloat16)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="extra actor config override, e.g. --set gradient_checkpointing=true (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="CPU threads shared by the ranks of one run (threads per rank = max(1, cores // ranks))")
    p.add_argument("--threads", type=int, default=None, help="threads per rank (overrides --cores)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per layout run")
    p.add_argument("--markdown", default=None, metavar="PATH", help="also write the output (command + tables) here")
    p.add_argument("--json", default=None, metavar="PATH", help="write every rank's raw numbers here")
    p.add_argument("--out-dir", default=None,
                   help="run folder (default: a temp dir, removed unless --keep or a failure)")
    p.add_argument("--keep", action="store_true", help="keep the temp run folder")
    # worker mode (set by the driver)
    p.add_argument("--checkpoint", action="store_true",
                   help="also time a sharded save, an asynchronous save (stall and total) and a load")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    p.add_argument("--ddp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.prompts < 1 or args.responses < 1:
        p.error("--steps must be >= 1, --warmup >= 0, --prompts and --responses >= 1")
    if args.worker:
        args.threads = args.threads or 1
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
