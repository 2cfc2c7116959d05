"""One command that validates and measures the trainer on a CUDA machine (about 6.5 minutes on one H100).

    .venv/bin/python benchmarks/gpu_suite.py                      # on one CUDA GPU: every section, full shapes
    .venv/bin/python benchmarks/gpu_suite.py --tiny               # the same code paths on CPU, tiny shapes (~1 min)
    .venv/bin/python benchmarks/gpu_suite.py --only decode,mfu    # some sections
    .venv/bin/python benchmarks/gpu_suite.py --only bigmodel --big-cases qwen3-4b-full

Sections (each one's failure is recorded and the others still run; the exit status is 1 if any failed):

* `tests`: `pytest -m gpu` (the tests that need CUDA; on CPU they are collected and skipped).
* `demo`: the README's stub demo on one process (`--config-name stub`), `--demo-steps` steps; on
  the full run the greedy test reward must rise.
* `decode`: the `hf` engine's decode tokens/s on a randomly initialised Qwen2.5-0.5B-shaped model
  (config built here, no download) at batch 64 and 256, against the memory-bandwidth bound: each
  decode step reads the weights once and every row's KV cache, so tokens/s <= batch x bandwidth /
  (weight bytes + KV bytes). Bandwidth: the device's datasheet figure where known (H100, H200, A100),
  and the copy bandwidth measured here (read + write of a 1 GiB buffer) in any case. Rows: the static path,
  the dynamic one (largest batch), the static path with compiled norm and MLP modules. The last row is
  the peer: transformers' own `generate` on the largest batch with its static cache (which it compiles
  on CUDA), same model, prompts and lengths.
* `decode_layers`: the same static rows with each whole decoder layer compiled for the decode steps
  (`rollout.compile_decode_scope=layers`), to set beside `decode`'s compiled modules.
* `mfu`: the actor's update (bf16 on CUDA: fp32 masters, and FSDP2's mixed precision beside them) on one packed
  micro-batch of 8k and of 16k tokens, activation checkpointing by the trainer's default rule (recompute only
  where the update would not fit without it; each row says which): 6 x params x tokens + attention FLOPs (LM
  head on action tokens) per second, over the device's dense bf16 peak (datasheet where known, else a measured
  bf16 matmul). Rows before 2026-11-29 recomputed every layer.
* `mfu_compiled`: the same at 16k with `actor.compile` (each decoder layer compiled), both heads, and the first
  compiled update's seconds (compiling included).
* `push`: weight push seconds per billion parameters (flat-bucket gather + the engine's copy), the
  trainer's `PolicySync.push` path.
* `step`: 3 trainer steps on the same 0.5B-shaped model (stub tokenizer and data, `eq.py`),
  the step's time breakdown from `metrics.jsonl`: with the GPU defaults (null actor lengths and checkpointing:
  the micro-batch chosen from free memory, recompute only for packs that need it; `rollout.sleep=null`: the
  engine stays awake where the update fits beside it), then with the engine sleeping through every update
  (`rollout.sleep=true`), then with the stub config's 8,192-token packs (as the step rows before 2026-11-29).
* `trl`: TRL's GRPOTrainer against this trainer on the same GPU, 0.5B-shaped model, data, group and
  lengths as `step` (`benchmarks/vs_trl.py --device cuda`, 3 steps each, after a warm-up one): step
  seconds and the ratio; needs the `trl` wheels (`bash scripts/offline_wheels.sh DIR 3.12 --bench`).
* `bigmodel`: one GPU, big models (issue 36): random-weight Llama-3.1-8B with LoRA rank 32 and
  Qwen3-4B fully fine-tuned, and the 8B LoRA again at 20K tokens (`--big-cases` picks), filled on the device through the trainer's
  loading path (RandomReader: no checkpoint written), one sequence of 16K tokens per update: peak
  memory per phase (update, rollout, update again after the engine's sleep), update time and MFU,
  rollout time, and for the full model the push in s per billion.
* `moe`: a random Qwen3-MoE-shaped model of 1.0B parameters (64 experts, top-8; issue 37), 3 trainer
  steps with router replay and the load-balancing loss, then 3 without replay: step time, memory, and
  the sampler-trainer KL of each (the engine samples in bf16).
* `head`: the log-prob head's memory and time (benchmarks/head_memory.py) on Qwen2.5-0.5B's vocabulary and
  width in bf16, 8,192 tokens: the plain and the fused head, each without and with an entropy bonus, the
  allocator's peak from the forward through the backward against the plan's `head_bytes` (issue 36).
* `ring`: ring attention's tile kernel on this device (issue 38) against SDPA over the same row: one rank's
  forward + backward of one attention layer (Qwen2.5-0.5B's 14 heads, 2 key/value heads, head dim 64, bf16 on
  CUDA) at 32K and 64K tokens, seconds and peak memory of each and the largest difference (a ring of one: what
  each rank computes per block, without the transfers; the kernel the trainer picks, torch's flash per tile).
* `vlm`: a random Qwen2.5-VL-shaped model (Qwen2.5-0.5B's text model and Qwen2.5-VL's 32-block vision tower,
  ~1.2B parameters; issue 39), 3 trainer steps on 448 x 448 pictures (256 image tokens each) of the stub's
  colour task: step time by phase, memory, the sampler-trainer KL.

Writes `gpu_suite.json` and `gpu_suite.md` into `--out` (default `runs/gpu_suite`). `--tiny` uses a
2-layer, 64-wide model and a handful of tokens, so the test suite runs it on CPU and the script
never rots. docs/gpu.md says how to install the few wheels a bare CUDA PyTorch image lacks.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

SECTIONS = ("tests", "demo", "decode", "decode_layers", "mfu", "mfu_compiled", "push", "step", "trl", "bigmodel", "moe", "vlm",
            "ring", "head")

# Datasheet figures (dense bf16 TFLOP/s, HBM TB/s) matched on torch.cuda.get_device_name().
DATASHEET = (
    (r"H200", 989.0, 4.8),
    (r"H100.*(SXM|HBM3)", 989.0, 3.35),
    (r"H100.*NVL", 835.0, 3.9),
    (r"H100.*PCIe", 756.0, 2.0),
    (r"H100", 989.0, 3.35),
    (r"A100.*80GB", 312.0, 2.04),
    (r"A100", 312.0, 1.56),
)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The model and workload sizes of a run (`--tiny` or full)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_new: int
    mfu_tokens: tuple[int, ...]
    step_prompts: int
    step_responses: int
    step_new_tokens: int
    ring_tokens: tuple[int, ...] = (32768, 65536)


# Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads / 2 kv heads, MLP 4864, vocab 151936, tied embeddings.
FULL = Shapes(896, 24, 14, 2, 4864, 151936, (64, 256), 128, 256, (8192, 16384), 16, 8, 128)
TINY = Shapes(64, 2, 4, 2, 128, 512, (4, 8), 8, 8, (256, 512), 2, 2, 8, (256,))


def qwen2_config(s: Shapes):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                       num_key_value_heads=s.kv_heads, intermediate_size=s.intermediate, vocab_size=s.vocab,
                       max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_model(s: Shapes, folder: Path) -> Path:
    """A randomly initialised model of these shapes with the stub's tokenizer (ids < 512 decode;
    the others decode to nothing), saved as a normal HF folder the trainer can load."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen2_config(s), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (ROOT / "stub" / "model" / name).exists():
            shutil.copy(ROOT / "stub" / "model" / name, folder / name)
    return folder


def datasheet(device_name: str) -> tuple[float | None, float | None]:
    for pattern, tflops, tbs in DATASHEET:
        if re.search(pattern, device_name):
            return tflops, tbs
    return None, None


def device_info() -> dict:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    tflops, tbs = datasheet(name) if cuda else (None, None)
    return {"device": name, "cuda": cuda, "torch": torch.__version__, "cuda_version": torch.version.cuda,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "datasheet_bf16_tflops": tflops, "datasheet_hbm_tb_s": tbs}


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measured_bandwidth_tb_s(device) -> float:
    """Copy bandwidth (bytes read + written per second) of a 1 GiB buffer (16 MiB on CPU)."""
    import torch

    n = (1 << 30 if device.type == "cuda" else 16 << 20) // 4
    a, b = torch.empty(n, device=device), torch.empty(n, device=device)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        b.copy_(a)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best / 1e12


def measured_matmul_tflops(device, dtype) -> float:
    import torch

    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def profiled(fn, path: Path, rows: int = 30) -> int:
    """Run `fn` once under torch.profiler and write its top ops (by device time on GPU, else CPU); returns the
    kernels it launched on the GPU (on CPU: the aten ops it ran, nested ones included)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        sync()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=rows))
    events = prof.events()
    if cuda:
        return sum(e.device_type == DeviceType.CUDA for e in events)
    return sum(e.name.startswith("aten::") for e in events)


# ------------------------------------------------------------------------------------------ sections


def child_env() -> dict[str, str]:
    """This process's environment for a child, less the rank and rendezvous that build_actor's one-rank group put
    there (the push and mfu sections): a child started with them would join this process's port."""
    from train.parallel.distributed import without_launcher_env

    return without_launcher_env(os.environ)


def run_logged(cmd: list[str], log: Path, timeout_s: int, env: dict | None = None) -> subprocess.CompletedProcess:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                              env={**child_env(), **(env or {})})
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode} (log: {log}):\n{tail}")
    return proc


def section_tests(args, work: Path) -> dict:
    log = work / "pytest_gpu.log"
    # Only the files that hold `gpu` tests: collecting the others would import the service and
    # verifiers stacks, which a bare CUDA image does not have (and the gpu tests do not need).
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in f.read_text())
    if not files:
        raise RuntimeError("no test file under tests/ has a test marked gpu")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout,
                              env=child_env())
    text = log.read_text()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", text)}
    if proc.returncode != 0 or counts.get("failed") or counts.get("error") or counts.get("errors"):
        raise RuntimeError(f"pytest -m gpu exited with {proc.returncode}: {text[-3000:]}")
    return {"files": files, "passed": counts.get("passed", 0), "skipped": counts.get("skipped", 0), "log": str(log)}


def trainer_cmd(save_dir: Path, overrides: list[str], config: str = "stub") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "train.trainer.grpo", "--config-name", config, f"trainer.save_dir={save_dir}",
            "trainer.progress_bar=false", *overrides]


def read_metrics(save_dir: Path) -> list[dict]:
    with open(save_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def section_demo(args, work: Path) -> dict:
    run = work / "demo"
    shutil.rmtree(run, ignore_errors=True)
    steps = args.demo_steps
    freq = max(1, steps // 2)
    start = time.perf_counter()
    run_logged(trainer_cmd(run, [f"trainer.total_steps={steps}", f"trainer.test_freq={freq}"]),
               work / "demo.log", args.timeout)
    wall = time.perf_counter() - start
    rows = read_metrics(run)
    tests = [(r["step"], r["rewards/test"]) for r in rows if "rewards/test" in r]
    steps_rows = [r for r in rows if "time/step_s" in r]
    out = {"steps": steps, "wall_s": wall, "test_reward": tests,
           "step_s": statistics.median(r["time/step_s"] for r in steps_rows) if steps_rows else None}
    if not tests:
        raise RuntimeError(f"the demo logged no rewards/test (metrics: {run / 'metrics.jsonl'})")
    if not args.tiny and not tests[-1][1] > tests[0][1]:
        raise RuntimeError(f"the demo's test reward did not rise: {tests}")
    return out


async def generate_all(engine, prompts: list[list[int]], sampling):
    """Every prompt in flight at once: the engine batches them."""
    return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))


def section_decode(args, work: Path, shapes: Shapes, info: dict, layers: bool = False) -> dict:
    """The decode rows (see the module docstring); `layers`: only the static path with compiled decoder layers
    (section `decode_layers`, apart so that a time limit which stops its compiling keeps the `decode` rows)."""
    import torch
    from transformers import AutoModelForCausalLM

    from train.engines.base import SamplingParams
    from train.engines.hf import HFEngine
    from train.engines.static_decode import uncompile_modules

    device = torch.device("cuda" if info["cuda"] else "cpu")
    dtype = torch.bfloat16 if info["cuda"] else torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen2_config(shapes), dtype=dtype).to(device)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * model.dtype.itemsize
    measured_bw = measured_bandwidth_tb_s(device)
    bw = info["datasheet_hbm_tb_s"] or measured_bw
    head_dim = shapes.hidden // shapes.heads
    kv_bytes_per_token = 2 * shapes.layers * shapes.kv_heads * head_dim * model.dtype.itemsize
    rows = []
    # The engine's path on this device (static cache + CUDA graphs on GPU), then the dynamic-cache
    # path it replaced (on the largest batch only: it is the slow one) for the before/after.
    # Then the static path with the engine's norm and MLP modules compiled (rollout.compile_decode); in the
    # decode_layers section, with each whole decoder layer compiled instead (rollout.compile_decode_scope=layers).
    static_here = None if info["cuda"] else True
    paths = ((("static+compiled layers", static_here, shapes.decode_batches),) if layers else
             (("static", static_here, shapes.decode_batches), ("dynamic", False, shapes.decode_batches[-1:]),
              ("static+compiled", static_here, shapes.decode_batches)))
    for path, static, batches in paths:
        uncompile_modules(model)  # (the engines share this model: copy_model=False)
        engine = HFEngine(model, eos_token_ids=[], max_batch_size=max(shapes.decode_batches), copy_model=False,
                          static_cache=static, compile_decode=path.startswith("static+compiled"),
                          compile_scope="layers" if path.endswith("layers") else "modules")
        try:
            for batch in batches:
                g = torch.Generator().manual_seed(batch)
                prompts = [torch.randint(3, shapes.vocab, (shapes.decode_prompt,), generator=g).tolist()
                           for _ in range(batch)]
                # An untimed pass first: graph captures and allocator warm-up, as every RL step after the first.
                warm = 4 if path == "dynamic" else shapes.decode_new
                warm_start = time.perf_counter()
                asyncio.run(generate_all(engine, prompts, SamplingParams(max_new_tokens=warm, ignore_eos=True)))
                warm_s = time.perf_counter() - warm_start
                new = shapes.decode_new
                sp = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)
                sync()
                start = time.perf_counter()
                out = asyncio.run(generate_all(engine, prompts, sp))
                sync()
                seconds = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for o in out)
                bound = decode_bound(shapes, batch, bw, weight_bytes, kv_bytes_per_token)
                if path != "dynamic" and batch == max(shapes.decode_batches):
                    short = SamplingParams(max_new_tokens=32, temperature=1.0, ignore_eos=True)
                    # The batch the queue would form, run in this thread so the profiler sees its CPU side too.
                    profiled(lambda: engine._generate_batch([(p, short, ()) for p in prompts]),
                             work / f"decode_profile{'_' + path[7:].replace(' ', '_') if 'compiled' in path else ''}.txt")
                rows.append({"path": path, "batch": batch, "new_tokens": new, "tokens": tokens, "seconds": seconds,
                             "tokens_per_s": tokens / seconds, "bound_tokens_per_s": bound,
                             "fraction_of_bound": tokens / seconds / bound, "cuda_graphs": engine.stats["cuda_graphs"],
                             "graph_error": engine.static_error, "warmup_s": warm_s,
                             "compiled_modules": engine.stats["compiled_modules"], "compile_error": engine.compile_error})
        finally:
            engine.close()
            del engine
    uncompile_modules(model)
    if not layers:  # plain transformers: the engine's compiled modules and grouped decode attention taken off
        model.set_attn_implementation("sdpa")
        rows.append(hf_generate_row(model, shapes, bw, weight_bytes, kv_bytes_per_token))
    del model
    if info["cuda"]:
        torch.cuda.empty_cache()
    return {"params": params, "weight_bytes": weight_bytes, "bandwidth_tb_s": bw,
            "bandwidth_source": "datasheet" if info["datasheet_hbm_tb_s"] else "measured copy",
            "measured_copy_tb_s": measured_bw, "batches": rows}


def decode_bound(shapes: Shapes, batch: int, bw_tb_s: float, weight_bytes: int, kv_bytes_per_token: int) -> float:
    """Tokens/s a decode of `batch` rows cannot beat: each step reads the weights once and every row's KV cache,
    whose mean context over the decode steps is the prompt and half the new tokens."""
    kv_bytes = batch * (shapes.decode_prompt + shapes.decode_new / 2) * kv_bytes_per_token
    return batch * bw_tb_s * 1e12 / (weight_bytes + kv_bytes)


def hf_generate_row(model, shapes: Shapes, bw: float, weight_bytes: int, kv_bytes_per_token: int) -> dict:
    """transformers' own `generate` on the largest decode batch, the peer to the engine's rows: a static cache
    (which `generate` compiles by itself on CUDA), temperature-1 sampling, every row to its full length."""
    import torch

    batch, new = max(shapes.decode_batches), shapes.decode_new
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, shapes.vocab, (batch, shapes.decode_prompt), generator=g).to(model.device)
    row = {"path": "transformers generate (static cache)", "batch": batch, "new_tokens": new}

    def run(max_new: int):
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0,
                              cache_implementation="static")

    try:
        with torch.no_grad():
            start = time.perf_counter()
            run(new)  # untimed: the compile and the cache's allocation, as the engine's warm-up pass
            sync()
            row["warmup_s"] = time.perf_counter() - start
            start = time.perf_counter()
            out = run(new)
            sync()
        seconds = time.perf_counter() - start
        tokens = (out.shape[1] - ids.shape[1]) * batch
        bound = decode_bound(shapes, batch, bw, weight_bytes, kv_bytes_per_token)
        row.update({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                    "bound_tokens_per_s": bound, "fraction_of_bound": tokens / seconds / bound})
    except Exception as exc:  # the peer's failure is a row's note, not the section's
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def section_trl(args, work: Path, shapes: Shapes, model_dir: Path, info: dict) -> dict:
    """benchmarks/vs_trl.py on this device: TRL's GRPOTrainer and ours, one after the other, same model and shapes."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:  # the peer is optional: say so in the table, fail nothing
        return {"skipped": "trl is not installed: carry its wheels (bash scripts/offline_wheels.sh DIR 3.12 --bench) "
                           "and install them with the others (docs/gpu.md)"}
    steps = 2 if args.tiny else 3  # after one warm-up step each: ~25 s less of a 330 s call than 4
    out = work / "vs_trl.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--device", "cuda" if info["cuda"] else "cpu",
           "--model", str(model_dir), "--prompts", str(shapes.step_prompts), "--responses", str(shapes.step_responses),
           "--max-new-tokens", str(shapes.step_new_tokens), "--steps", str(steps), "--warmup", "1",
           "--timeout", str(args.timeout), "--out", str(out)]
    run_logged(cmd, work / "vs_trl.log", args.timeout * 2)
    result = json.loads(out.read_text())
    keep = ("step_s_mean", "samples_per_s", "rollout_s_mean", "update_s_mean", "weight_sync_s_mean", "generate_s_mean",
            "wall_s")
    return {"steps": steps, "warmup": 1, "trl_version": result["settings"]["trl"],
            "ours": {k: v for k, v in result["ours"].items() if k in keep},
            "trl": {k: v for k, v in result["trl"].items() if k in keep},
            "ours_over_trl_samples_per_s": result["ratio_samples_per_s_ours_over_trl"]}


def build_actor(model_dir: Path, max_tokens: int, info: dict, lora: dict | None = None, fused_head: bool = False,
                compile_layers: bool = False, master_weights: bool | None = None, checkpointing: bool | None = True,
                offload_optimizer: bool = False):
    """The actor of a section at `max_tokens` per micro-batch. `checkpointing` None: the trainer's default rule
    (on a GPU, on only for the packs whose update would not fit without it; memory_plan.recompute_above)."""
    import torch
    from omegaconf import OmegaConf

    from train.models.actor import Actor
    from train.parallel.distributed import init_distributed

    ctx = init_distributed()
    cfg = OmegaConf.load(ROOT / "config" / "grpo.yaml").actor
    cfg.model_name = str(model_dir)
    cfg.max_length_per_device = max_tokens
    cfg.dtype = "bfloat16" if info["cuda"] else "float32"
    cfg.gradient_checkpointing = checkpointing
    cfg.use_liger_kernel = fused_head
    cfg.compile = compile_layers
    cfg.master_weights = master_weights  # null: fp32 masters where they apply and fit (the trainer's default)
    cfg.offload_optimizer = offload_optimizer
    if lora:
        cfg.lora.rank, cfg.lora.alpha = lora["rank"], lora["alpha"]
    torch.manual_seed(0)
    return Actor(cfg, ctx, str(model_dir), pad_token_id=0, train=True, temperature=1.0, total_updates=100), ctx


def fixed_batch(tokens: int, vocab: int, groups: int = 2, per_group: int = 4):
    """`groups` x `per_group` samples of exactly tokens / (groups x per_group) tokens each, a quarter
    of them prompt; random ids, group-normalised random advantages, zero sampler log-probs."""
    import torch

    g = torch.Generator().manual_seed(1234)
    length = tokens // (groups * per_group)
    prompt_len = max(1, length // 4)
    ids, masks, adv, sampler = [], [], [], []
    for _ in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        rewards = torch.randn(per_group, generator=g)
        group_adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for j in range(per_group):
            response = torch.randint(3, vocab, (length - prompt_len,), generator=g).tolist()
            ids.append(prompt + response)
            masks.append([0] * prompt_len + [1] * (length - prompt_len))
            adv.append(float(group_adv[j]))
            sampler.append([0.0] * length)
    return ids, masks, adv, sampler, length - prompt_len


def mfu_peak(info: dict) -> tuple[float, str]:
    """The dense bf16 peak MFU is taken against: the datasheet's where known, else a measured matmul."""
    import torch

    if info["datasheet_bf16_tflops"] is not None:
        return info["datasheet_bf16_tflops"], "datasheet"
    device = torch.device("cuda" if info["cuda"] else "cpu")
    return measured_matmul_tflops(device, torch.bfloat16 if info["cuda"] else torch.float32), "measured matmul"


def section_mfu(args, work: Path, shapes: Shapes, info: dict, model_dir: Path) -> dict:
    """The update's MFU: the eager actor with the plain and the fused head at each length, then at the longest
    length with FSDP2's mixed precision over one rank (actor.master_weights=false) beside the default's fp32
    masters. Returns the default actor (the push section's) under `_actor`."""
    import torch

    peak, source = mfu_peak(info)
    actor, ctx = build_actor(model_dir, max(shapes.mfu_tokens), info, checkpointing=None)
    # The default LM head (logits of the action tokens, then log-softmax) and the fused one
    # (actor.use_liger_kernel: chunked, no [tokens, vocab] logits kept).
    rows = [mfu_row(actor, ctx, work, shapes, info, model_dir, peak, fused, tokens)
            for fused in (False, True) for tokens in shapes.mfu_tokens]
    if actor.masters is not None:  # the same update as FSDP2 casts it, per parameter at every forward and backward
        fsdp, _ = build_actor(model_dir, max(shapes.mfu_tokens), info, master_weights=False, checkpointing=None)
        rows.append(mfu_row(fsdp, ctx, work, shapes, info, model_dir, peak, False, max(shapes.mfu_tokens)))
        del fsdp
        if info["cuda"]:
            torch.cuda.empty_cache()
    return {"peak_tflops": peak, "peak_source": source, "micro_batches": rows, "_actor": actor}


def section_mfu_compiled(args, work: Path, shapes: Shapes, info: dict, model_dir: Path) -> dict:
    """The same update with `actor.compile` (each decoder layer compiled) at the longest length, both heads; its
    own section, so a time limit that stops it keeps the eager figures."""
    peak, source = mfu_peak(info)
    actor, ctx = build_actor(model_dir, max(shapes.mfu_tokens), info, compile_layers=True, checkpointing=None)
    rows = [mfu_row(actor, ctx, work, shapes, info, model_dir, peak, fused, max(shapes.mfu_tokens))
            for fused in (False, True)]
    return {"peak_tflops": peak, "peak_source": source, "micro_batches": rows}


def mfu_row(actor, ctx, work: Path, shapes: Shapes, info: dict, model_dir: Path, peak: float, fused: bool,
            tokens: int) -> dict:
    """One update of 2 groups of 4 samples, each tokens/8 long (a quarter prompt), packed into one micro-batch:
    the median of two timed updates after a warm-up, its TFLOP/s and MFU; a profile at the longest length."""
    import torch

    from train.parallel.fused_logprobs import FusedLogprobHead
    from train.parallel.step_batch import dispatch, exchange_index
    from vs_trl import update_gflop

    actor.fused_head = FusedLogprobHead(actor.model) if fused else None
    if info["cuda"]:
        torch.cuda.reset_peak_memory_stats()
    ids, masks, adv, sampler, max_new = fixed_batch(tokens, shapes.vocab)
    index = exchange_index([len(x) for x in ids], list(range(len(ids))), [0.0] * len(ids), ctx.device)
    batch = dispatch(index, ids, masks, sampler, actor.layout, 1, ctx.device)
    batch.fields["advantages"] = [adv[g] * m for g, m in zip(batch.members, batch.mask)]
    total = sum(len(x) for x in ids)
    actions = sum(sum(m) for m in masks)
    times = []
    for _ in range(3):  # the first is a warm-up (with actor.compile, where the layers compile)
        sync()
        start = time.perf_counter()
        actor.update(batch, max_new)
        sync()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    kernels = None
    if tokens == max(shapes.mfu_tokens):  # the launches per update: what bounds a small model's update on a GPU
        fsdp_mixed = actor.masters is None and actor.cfg.dtype == "bfloat16"  # the row beside the masters' default
        tag = ("_fused" if fused else "") + ("_compiled" if actor.cfg.compile else "") + ("_fsdp" if fsdp_mixed else "")
        kernels = profiled(lambda: actor.update(batch, max_new), work / f"mfu_profile_{tokens}{tag}.txt")
    gflop = update_gflop(str(model_dir), len(ids), total / len(ids), actions / len(ids))
    tflops = gflop / seconds / 1e3
    # (with a recompute limit, the last update's own choice: the limit follows the memory free when it starts)
    recompute = bool(actor.cfg.gradient_checkpointing) and (actor.recompute_stats is None
                                                              or actor.recompute_stats[1] > 0)
    return {"lm_head": "fused" if fused else "plain", "compiled": bool(actor.cfg.compile), "recompute": recompute,
            "precision": ("fp32 masters" if actor.masters is not None else
                          "FSDP2 mixed" if actor.cfg.dtype == "bfloat16" else actor.cfg.dtype), "tokens": total,
            "seconds": seconds, "warmup_s": times[0], "tflops": tflops, "mfu": tflops / peak,
            ("kernels_per_update" if info["cuda"] else "ops_per_update"): kernels,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if info["cuda"] else None}


def section_ring(shapes: Shapes, info: dict) -> dict:
    """One rank's ring attention (a ring of one: the tiles each rank runs per key/value block, no transfers)
    against SDPA (is_causal) on the same row, forward + backward; the kernel is the one the trainer picks for
    this device (train/parallel/ring_attention.py::block_kernel)."""
    import torch

    from train.parallel import ring_attention as ring
    from train.parallel.distributed import init_distributed

    init_distributed()  # a one-rank group: the ring's group
    device = torch.device("cuda" if info["cuda"] else "cpu")
    dtype = torch.bfloat16 if info["cuda"] else torch.float32
    heads, kv_heads, dim = 14, 2, 64
    kernel = ring.block_kernel(device, dtype)
    rows = []
    for tokens in shapes.ring_tokens:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(heads, tokens, dim, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(kv_heads, tokens, dim, device=device, dtype=dtype, generator=g) for _ in range(2))
        weight = torch.randn(heads, tokens, dim, device=device, dtype=dtype, generator=g)
        row = ring.RingRow(seg=torch.zeros(tokens, dtype=torch.long, device=device),
                           pos=torch.arange(tokens, device=device), prefix=torch.full((tokens,), -1, device=device))
        runs = {
            "sdpa": lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                a[None], b.repeat_interleave(heads // kv_heads, 0)[None], c.repeat_interleave(heads // kv_heads, 0)[None],
                is_causal=True)[0],
            "ring": lambda a, b, c: ring.ring_attention(a[None], b[None], c[None], row, torch.distributed.group.WORLD,
                                                        None, None, kernel=kernel)[0]}
        out = {}
        for name, fn in runs.items():
            times = []
            for i in range(2):  # the first is a warm-up
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                if info["cuda"]:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                sync()
                start = time.perf_counter()
                result = fn(*leaves)
                (result.float() * weight).sum().backward()
                sync()
                times.append(time.perf_counter() - start)
            out[name] = (times[-1], result.detach().float(),
                         torch.cuda.max_memory_allocated() / 2**30 if info["cuda"] else None)
        rows.append({"tokens": tokens, "kernel": kernel.__name__, "sdpa_s": out["sdpa"][0], "ring_s": out["ring"][0],
                     "sdpa_peak_gib": out["sdpa"][2], "ring_peak_gib": out["ring"][2],
                     "max_abs_diff": float((out["ring"][1] - out["sdpa"][1]).abs().max())})
    return {"heads": heads, "kv_heads": kv_heads, "dim": dim, "dtype": str(dtype), "rows": rows}


def section_head(shapes: Shapes, info: dict) -> dict:
    """benchmarks/head_memory.py's rows at the model's vocabulary and width, on its first micro-batch length."""
    import torch

    from head_memory import measure

    device = torch.device("cuda" if info["cuda"] else "cpu")
    return {"rows": measure(device, shapes.mfu_tokens[0], shapes.vocab, shapes.hidden)}


def section_push(args, work: Path, info: dict, actor) -> dict:
    import torch

    from train.engines.hf import HFEngine
    from train.parallel.weight_sync import unique_state
    from train.trainer.policy_sync import PolicySync

    engine = HFEngine.from_pretrained(args.model_dir, device=torch.device("cuda" if info["cuda"] else "cpu"),
                                      eos_token_ids=[])
    try:
        out = {}
        params = sum(t.numel() for _, t in unique_state(actor.model))
        for verify in (True, False):  # trainer.verify_push on (the default) and off
            push = PolicySync(actor.model, engine, 512, None, {"actor": actor}, log=None, verify=verify)
            push.push()  # warm-up
            times = [push.push() for _ in range(3)]
            profiled(push.push, work / f"push_profile_verify_{verify}.txt")
            seconds = statistics.median(times)
            out.update({f"seconds{'' if verify else '_unverified'}": seconds,
                        f"s_per_billion{'' if verify else '_unverified'}": seconds / params * 1e9})
    finally:
        engine.close()
    # with fp32 masters the actor's weights are bf16 already: a push sends them without a cast
    return {"params": params, **out, "engine_dtype": str(engine.dtype), "master_weights": actor.masters is not None}


def step_overrides(model: Path, shapes: Shapes, *flags: str) -> list[str]:
    """The trainer settings of a section's short runs: 3 steps of the `step` shapes' batch, no evaluation, no
    checkpoint, every group kept, and `flags`."""
    return [f"actor.model_name={model}", "trainer.total_steps=3", "trainer.test_freq=null",
            f"data.prompts_per_rollout={shapes.step_prompts}", f"data.responses_per_prompt={shapes.step_responses}",
            f"rollout.train_sampling_params.max_new_tokens={shapes.step_new_tokens}",
            "rollout.dynamic_filtering=false", "trainer.save_freq=null", *flags]


# The step section's runs: the GPU defaults (actor lengths, checkpointing and rollout.sleep all null), the same
# with the engine sleeping through every update, and the stub config's 8,192-token packs (the step rows before
# 2026-11-29): name -> overrides.
STEP_RUNS = {"default": ("actor.max_length_per_device=null", "actor.gradient_checkpointing=null", "rollout.sleep=null"),
             "sleep_true": ("actor.max_length_per_device=null", "actor.gradient_checkpointing=null", "rollout.sleep=true"),
             "packs_8192": ("rollout.sleep=null",)}


def section_step(args, work: Path, shapes: Shapes, model_dir: Path) -> dict:
    """STEP_RUNS, each 3 trainer steps; the default's means at the top level, the others' under their names."""
    out = {}
    for name, flags in STEP_RUNS.items():
        run = work / f"step_{name}"
        shutil.rmtree(run, ignore_errors=True)
        run_logged(trainer_cmd(run, step_overrides(model_dir, shapes, *flags)), work / f"step_{name}.log", args.timeout)
        means = step_means(run, ("engine/slept", "engine/cuda_graphs", "actor/recompute_fraction",
                                 "actor/recompute_limit"))
        if name == "default":
            out.update(means)
        else:
            out[name] = means
    return out


def step_means(run: Path, keys: tuple[str, ...] = ()) -> dict:
    """The run's step count, and the mean of its time/ and memory/ metrics (memory/: CUDA only) and of `keys`
    over its steps after the first (which pays for warm-up)."""
    rows = [r for r in read_metrics(run) if "time/step_s" in r]
    keep = rows[1:] or rows
    names = sorted({k for r in keep for k in r if k.startswith(("time/", "memory/")) or k in keys})
    return {"steps": len(rows), **{k: statistics.mean(r[k] for r in keep if k in r) for k in names}}


# A mixture of experts on one GPU (issue 37): a Qwen3-MoE shape of 1.0B parameters (0.25B active per token:
# 16 layers of hidden 1024, 64 experts of 256, top-8, Qwen's vocabulary), three trainer steps with router
# replay and the load-balancing loss, then without replay (the engine samples in bf16, the actor is fp32).
MOE_FULL = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                intermediate_size=2816, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
                vocab_size=151936)
MOE_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=512)


def section_moe(args, work: Path, shapes: Shapes) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = work / "moe_model"
    shutil.rmtree(folder, ignore_errors=True)
    config = AutoConfig.for_model("qwen3_moe", **(MOE_TINY if args.tiny else MOE_FULL), norm_topk_prob=True,
                                  max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "stub" / "model" / name, folder / name)
    out: dict = {"params": params, "experts": config.num_experts, "top_k": config.num_experts_per_tok}
    for name, flags in (("replay", ["actor.router_replay=response", "actor.router_aux_loss_coef=0.001"]),
                        ("no_replay", [])):
        run = work / f"moe_{name}"
        shutil.rmtree(run, ignore_errors=True)
        run_logged(trainer_cmd(run, step_overrides(folder, shapes, *flags)), work / f"moe_{name}.log", args.timeout)
        out[name] = step_means(run, ("actor/sampler_kl", "actor/sampler_abs_diff", "actor/router_aux_loss"))
    shutil.rmtree(folder, ignore_errors=True)
    return out


def section_vlm(args, work: Path, shapes: Shapes) -> dict:
    """3 trainer steps of a random Qwen2.5-VL-shaped model on big pictures of the colour task (see the docstring)."""
    import random

    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    try:  # no torchvision needed (transformers 5.2x); older releases have one class
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    build = load_vlm_builder()
    folder, data = work / "vlm_model", work / "vlm_data"
    shutil.rmtree(folder, ignore_errors=True)
    tok = build.build_tokenizer(folder)
    tiny = build.vlm_config(tok)
    if args.tiny:
        config, side = tiny, 56
    else:  # Qwen2.5-0.5B's text model, Qwen2.5-VL's vision tower (depth 32, width 1280), 448 px pictures
        config, side = Qwen2_5_VLConfig(
            text_config=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                              "mrope_section": [16, 24, 24]}, tie_word_embeddings=True,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None),
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=896,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[7, 15, 23, 31], in_channels=3),
            vision_start_token_id=tiny.vision_start_token_id, vision_end_token_id=tiny.vision_end_token_id,
            image_token_id=tiny.image_token_id, video_token_id=tiny.video_token_id, tie_word_embeddings=True,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None), 448
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    ImageProcessor(min_pixels=side * side, max_pixels=side * side).save_pretrained(folder)
    rng = random.Random(0)
    data.mkdir(parents=True, exist_ok=True)
    pairs = [(c, sh) for c in build.COLOURS for sh in build.SHAPES]
    rows = []
    for i in range(64):
        colour, shape = pairs[i % len(pairs)]
        picture = build.render(colour, shape, rng).resize((side, side))
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": build.data_url(picture)},
                                                               {"type": "text", "text": build.QUESTION.format(shape=shape)}]}],
                     "answer": colour})
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = work / "vlm_run"
    shutil.rmtree(run, ignore_errors=True)
    overrides = [f"actor.model_name={folder}", f"data.train_data_path={data / 'train.jsonl'}", "data.test_data_path=null",
                 "trainer.total_steps=3", "trainer.test_freq=null", f"data.prompts_per_rollout={shapes.step_prompts}",
                 f"data.responses_per_prompt={shapes.step_responses}", "rollout.dynamic_filtering=false",
                 "trainer.save_freq=null", "rollout.train_sampling_params.max_new_tokens=8"]
    run_logged(trainer_cmd(run, overrides, config="vlm_stub"), work / "vlm.log", args.timeout)
    shutil.rmtree(folder, ignore_errors=True)
    return {"params": params, "image_side": side, "image_tokens": (side // 28) ** 2,
            **step_means(run, ("actor/sampler_kl", "actor/sampler_abs_diff"))}


def load_vlm_builder():
    """stub/build_vlm_stub.py (the VLM stub's tokenizer, config and pictures) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_vlm_stub", ROOT / "stub" / "build_vlm_stub.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Big models on one GPU (issue 36): Llama-3.1-8B with LoRA rank 32 and Qwen3-4B fully fine-tuned, one
# sequence of `tokens` per update. `--tiny` keeps the families at toy sizes.
BIG = (  # shapes from train/models/memory_plan.py's presets, whose estimates these runs check
    dict(name="llama3.1-8b-lora32", preset="llama3.1-8b", lora_rank=32, tokens=16384),
    dict(name="qwen3-4b-full", preset="qwen3-4b", lora_rank=0, tokens=16384),
    # Unsloth's published point: Llama-3.1-8B GRPO at 20K context on one GPU in 54.3 GB
    dict(name="llama3.1-8b-lora32-20k", preset="llama3.1-8b", lora_rank=32, tokens=20480),
    # actor.offload_optimizer: the moments on the host between steps, a bucket at a time on the GPU in the step.
    # Run only when named (--big-cases qwen3-4b-full-offload): the two standard calls have no room for it.
    dict(name="qwen3-4b-full-offload", preset="qwen3-4b", lora_rank=0, tokens=16384, offload_optimizer=True,
         only_when_named=True),
)
BIG_TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=512, max_position_embeddings=4096, head_dim=16)


def big_config(case: dict, tiny: bool):
    from transformers import AutoConfig

    from train.models.memory_plan import PRESETS, preset_config

    if not tiny:
        return preset_config(case["preset"])
    preset = PRESETS[case["preset"]]
    return AutoConfig.for_model(preset["model_type"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                tie_word_embeddings=preset["tie_word_embeddings"], **BIG_TINY_CONFIG)


class RandomReader:
    """Stands in for train.models.model_init.WeightReader in the big-model section: every tensor of the
    model's own state dict, drawn N(0, 0.02) on the device block by block, so no 16 GB checkpoint
    is written or read (the loading path, slices and all, is the trainer's own)."""

    def __init__(self, folder: str, device) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.folder, self.device = folder, device
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def keys(self) -> list[str]:
        return list(self.shapes)

    def read(self, name: str, index=None):
        import torch

        shape = self.shapes[name]
        if index is not None:
            shape = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape))
        out = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        return out.fill_(1.0) if name.endswith("norm.weight") else out.normal_(0.0, 0.02)


def gib(n: float) -> float:
    return n / 2**30


def section_bigmodel(args, work: Path, info: dict) -> dict:
    """Per case: the actor (bf16 compute; LoRA keeps its frozen base in bf16) filled from random
    weights; a first update on one packed sequence of `tokens` (gradient checkpointing, fused
    log-prob head), which allocates the optimizer state; then a step as the trainer runs it: a bf16
    engine of the same model (with LoRA, over the actor's own frozen base: rollout.share_actor_base)
    generates 8 replies (1024-token prompts, 128 new), a full model is pushed into it, the engine
    sleeps (its own weights to host memory), and the update runs again (timed).
    Peak device memory per phase; the update's model FLOP/s (6 x params x tokens + attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    import train.models.model_init as model_init
    from train.engines.base import SamplingParams
    from train.engines.hf import HFEngine
    from train.models.lora import LoraSettings
    from train.models.memory_plan import plan
    from train.models.shared_base import engine_model_over
    from train.parallel.step_batch import dispatch, exchange_index
    from vs_trl import update_gflop

    cuda = info["cuda"]
    device = torch.device("cuda" if cuda else "cpu")
    peak_tflops = info["datasheet_bf16_tflops"] or measured_matmul_tflops(device, torch.bfloat16 if cuda else torch.float32)
    mem = (lambda: gib(torch.cuda.max_memory_allocated())) if cuda else (lambda: None)
    rows = []
    for case in BIG:
        if case["name"] not in args.big_cases and (args.big_cases or case.get("only_when_named")):
            continue
        tokens = 512 if args.tiny else case["tokens"]
        prompt_len, new, replies = (16, 8, 2) if args.tiny else (1024, 128, 8)
        row: dict = {"case": case["name"], "tokens": tokens, "lora_rank": case["lora_rank"]}
        rows.append(row)
        actor = engine = engine_model = batch = push = None
        folder = Path(tempfile.mkdtemp(prefix="gpu_suite_big_"))
        real_reader = model_init.WeightReader
        try:
            config = big_config(case, args.tiny)
            config.save_pretrained(folder)
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if (ROOT / "stub" / "model" / name).exists():
                    shutil.copy(ROOT / "stub" / "model" / name, folder / name)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            model_init.WeightReader = lambda f: RandomReader(f, device)  # noqa: E731
            lora = {"rank": case["lora_rank"], "alpha": 2 * case["lora_rank"]} if case["lora_rank"] else None
            offload = case.get("offload_optimizer", False)
            actor, ctx = build_actor(folder, tokens, info, lora=lora, fused_head=True, offload_optimizer=offload)
            row["build_s"] = time.perf_counter() - start
            held = list(actor.model.parameters()) + (actor.masters.masters if actor.masters is not None else [])
            row["actor_gib"] = gib(sum(p.numel() * p.element_size() for p in held))  # with the fp32 masters, if any
            row["params"] = sum(p.numel() for p in actor.model.parameters())
            row["trainable_params"] = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
            ids, masks, _, sampler, max_new = fixed_batch(tokens, config.vocab_size, groups=1, per_group=1)
            index = exchange_index([len(x) for x in ids], [0], [0.0], ctx.device)
            batch = dispatch(index, ids, masks, sampler, actor.layout, 1, ctx.device)
            batch.fields["advantages"] = [1.0 * m for m in batch.mask]
            sync()
            start = time.perf_counter()
            actor.update(batch, max_new)  # the first update allocates the optimizer state: steady state after it
            sync()
            row["first_update_s"], row["first_update_peak_gib"] = time.perf_counter() - start, mem()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            # The rollout: a bf16 engine of the same model. With LoRA it borrows the actor's frozen base, as the
            # trainer's engine does (rollout.share_actor_base); a full model's engine holds its own copy.
            borrowed: list[str] = []
            if lora:
                engine_model, borrowed = engine_model_over(actor.model, LoraSettings(rank=lora["rank"],
                                                                                     alpha=float(lora["alpha"])))
            else:
                with torch.device(device):
                    torch.manual_seed(0)
                    engine_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
            engine = HFEngine(engine_model, eos_token_ids=[], max_batch_size=replies, copy_model=False, borrowed=borrowed)
            own = [t for n, t in engine.model.state_dict().items() if n not in engine.borrowed]
            row["engine_gib"] = gib(sum(t.numel() * t.element_size() for t in own))  # what the engine adds
            row["engine_borrows_base"] = bool(borrowed)
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(replies)]
            sync()
            start = time.perf_counter()
            asyncio.run(generate_all(engine, prompts, SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)))
            sync()
            row["rollout_s"] = time.perf_counter() - start
            row["rollout_peak_gib"] = mem()
            if not lora:  # a full model's push at this size (a LoRA push sends adapters only)
                from train.trainer.policy_sync import PolicySync

                for verify in (True, False):
                    push = PolicySync(actor.model, engine, 512, None, {"actor": actor}, log=None, verify=verify)
                    push.push()  # warm-up
                    row[f"push_s_per_billion{'' if verify else '_unverified'}"] = push.push() / row["params"] * 1e9
            engine.sleep()  # as the trainer does before its update: the engine's weights go to host memory
            row["engine_host_gib"] = gib(engine.host_bytes)  # (its page-locked slab; none on CPU or all borrowed)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            start = time.perf_counter()
            actor.update(batch, max_new)
            sync()
            row["update_s"] = time.perf_counter() - start
            row["update_peak_gib"] = mem()
            actions = sum(masks[0])
            tflops = update_gflop(str(folder), 1, len(ids[0]), actions) / row["update_s"] / 1e3
            row.update({"update_tflops": tflops, "mfu": tflops / peak_tflops,
                        "step_s": row["rollout_s"] + row["update_s"]})
            # train/models/memory_plan.py's estimate of the same step, to check it against the measurement
            masters = actor.masters is not None  # actor.master_weights=null: taken where the plan fits
            estimate = plan(config, seq=tokens, lora_rank=case["lora_rank"], share_base=True, replies=replies,
                            prompt=prompt_len, new=new, master_weights=masters, offload_optimizer=offload)
            if offload:  # the moments on the host but for one bucket in the step (optim.HostMoments)
                row["host_moments_gib"] = gib(actor.host_moments.host_bytes)
            row.update({"estimate_update_gib": gib(estimate.update_peak), "estimate_rollout_gib": gib(estimate.rollout_peak),
                        "master_weights": masters, "offload_optimizer": offload})
        except Exception as exc:  # one case's failure (say, out of memory) is recorded; the next still runs
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            model_init.WeightReader = real_reader
            if engine is not None:
                engine.close()
            # Every reference to the case's tensors (the push holds the actor's model): the next case
            # and the next section start from an empty device (a leak here ran the mfu section out of memory).
            del actor, engine, engine_model, batch, push
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            shutil.rmtree(folder, ignore_errors=True)
        print(f"[gpu_suite] bigmodel {json.dumps(row, default=str)}", flush=True)
    if any("error" in r for r in rows):
        raise RuntimeError("; ".join(f"{r['case']}: {r['error']}" for r in rows if "error" in r) + f" (rows: {rows})")
    left = gib(torch.cuda.memory_allocated()) if cuda else None
    if left is not None and left > 1.0:
        raise RuntimeError(f"the big-model cases left {left:.1f} GiB allocated: a reference outlived its case")
    return {"peak_tflops": peak_tflops, "cases": rows, "left_allocated_gib": left}


# ------------------------------------------------------------------------------------------ report


def markdown(result: dict) -> str:
    info = result["device"]
    lines = [f"# GPU suite: {info['device']}", "",
             f"torch {info['torch']} (CUDA {info['cuda_version']}), transformers {info['transformers']}, "
             f"Python {info['python']}; {result['date']}; {'tiny shapes (--tiny)' if result['tiny'] else 'full shapes'}; "
             f"`{result['command']}`", "", "| section | result |", "|---|---|"]
    s = result["sections"]

    def cell(name: str, text) -> None:
        if name in s:
            lines.append(f"| {name} | {('FAILED: ' + s[name]['error'].splitlines()[0]) if 'error' in s[name] else text(s[name])} |")

    cell("tests", lambda r: f"{r['passed']} passed, {r['skipped']} skipped")
    cell("demo", lambda r: f"test reward {' -> '.join(f'{v:.3f} (step {k})' for k, v in r['test_reward'])}; "
                           f"{r['steps']} steps in {r['wall_s']:.0f} s")
    def decode(r: dict) -> str:
        return "; ".join(
            f"{b.get('path', 'static')} batch {b['batch']}: " + (f"FAILED {b['error']}" if "error" in b else
            f"{b['tokens_per_s']:,.0f} tok/s = {100 * b['fraction_of_bound']:.2g}% of the bound ({b['bound_tokens_per_s']:,.0f})")
            for b in r["batches"]) + (f" (bandwidth {r['bandwidth_tb_s']:.2f} TB/s, {r['bandwidth_source']}; "
                                      f"measured copy {r['measured_copy_tb_s']:.2f})")

    cell("decode", decode)
    cell("decode_layers", decode)

    def mfu(r: dict) -> str:
        return "; ".join(
            f"{m.get('lm_head', 'plain')} head{', compiled layers' if m.get('compiled') else ''}"
            f"{', ' + m['precision'] if m.get('precision') else ''}"
            f"{', recompute' if m.get('recompute') else ', no recompute' if 'recompute' in m else ''}, {m['tokens']} tokens: "
            f"{m['seconds']:.3f} s, {m['tflops']:.3g} TFLOP/s = MFU {100 * m['mfu']:.1f}%"
            + (f" (first update {m['warmup_s']:.1f} s)" if m.get('compiled') else "")
            + (f", {m['kernels_per_update']:,} kernels per update" if m.get("kernels_per_update") else "")
            + (f", {m['ops_per_update']:,} aten ops per update" if m.get("ops_per_update") else "")
            for m in r["micro_batches"]) + f" (peak {r['peak_tflops']:.3g} TFLOP/s, {r['peak_source']})"

    cell("mfu", mfu)
    cell("mfu_compiled", mfu)
    cell("push", lambda r: f"{r['seconds']:.4g} s for {r['params'] / 1e6:.3g}M params = {r['s_per_billion']:.3g} s per "
                           f"billion (verified); {r['s_per_billion_unverified']:.3g} s per billion with verify_push off")
    cell("bigmodel", lambda r: "; ".join(
        f"{c['case']} at {c['tokens']} tokens: " + (f"FAILED {c['error']}" if "error" in c else
        f"rollout peak {c['rollout_peak_gib'] or 0:.1f} GiB (estimate {c['estimate_rollout_gib']:.1f}), update peak "
        f"{c['update_peak_gib'] or 0:.1f} GiB (estimate {c['estimate_update_gib']:.1f}), "
        f"update {c['update_s']:.2f} s (MFU {100 * c['mfu']:.1f}%), rollout {c['rollout_s']:.2f} s")
        for c in r["cases"]))
    cell("moe", lambda r: f"{r['params'] / 1e9:.2f}B params, {r['experts']} experts top-{r['top_k']}: " + "; ".join(
        f"{k.replace('_', ' ')}: step {v.get('time/step_s', 0):.2f} s, sampler KL {v.get('actor/sampler_kl', 0):.2e}"
        + "".join(f", {m.removeprefix('memory/')} {x:.1f} GiB" for m, x in v.items() if m.startswith("memory/"))
        for k, v in r.items() if isinstance(v, dict)))
    cell("trl", lambda r: f"skipped: {r['skipped']}" if "skipped" in r else f"ours {r['ours']['step_s_mean']:.3f} s/step (rollout {r['ours'].get('rollout_s_mean', 0):.3f}, "
                          f"update {r['ours'].get('update_s_mean', 0):.3f}, push {r['ours'].get('weight_sync_s_mean', 0):.4f}); "
                          f"TRL {r['trl_version']} {r['trl']['step_s_mean']:.3f} s/step (generate + reward "
                          f"{r['trl'].get('generate_s_mean', 0):.3f}); ours / TRL samples/s "
                          f"**{r['ours_over_trl_samples_per_s']:.2f}x**")
    def step_cell(r: dict) -> str:
        return (", ".join(f"{k.removeprefix('time/')} {v:.3f}" for k, v in r.items() if k.startswith("time/"))
                + "".join(f"; {k.removeprefix('memory/')} {v:.1f} GiB" for k, v in r.items() if k.startswith("memory/"))
                + (f"; engine slept {r['engine/slept']:.0f}, {r['engine/cuda_graphs']:.0f} CUDA graphs"
                   if "engine/slept" in r else "")
                + (f"; packs recomputed {r['actor/recompute_fraction']:.2f} (limit {r['actor/recompute_limit']:.0f})"
                   if "actor/recompute_fraction" in r else ""))

    cell("step", lambda r: step_cell(r) + "".join(f" || {name}: {step_cell(r[name])}" for name in STEP_RUNS
                                                  if isinstance(r.get(name), dict)))
    cell("ring", lambda r: "; ".join(
        f"{x['tokens']} tokens: {x['kernel']} {x['ring_s']:.3f} s vs SDPA {x['sdpa_s']:.3f} s "
        f"(x{x['ring_s'] / x['sdpa_s']:.2f})" + (f", peak {x['ring_peak_gib']:.2f} vs {x['sdpa_peak_gib']:.2f} GiB"
                                                  if x["ring_peak_gib"] is not None else "")
        + f", max diff {x['max_abs_diff']:.1e}" for x in r["rows"]))
    cell("head", lambda r: "; ".join(
        f"{x['head']}{' + entropy bonus' if x['entropy_bonus'] else ''}, {x['tokens']} tokens: peak "
        f"{x['peak_bytes'] / 2**30:.2f} GiB (plan {x['planned_bytes'] / 2**30:.2f}), {x['seconds'] * 1e3:.1f} ms"
        for x in r["rows"]))
    cell("vlm", lambda r: f"{r['params'] / 1e9:.2f}B params, {r['image_side']} px pictures ({r['image_tokens']} tokens): "
         + ", ".join(f"{k.removeprefix('time/')} {v:.3f}" for k, v in r.items() if k.startswith("time/"))
         + f"; sampler KL {r.get('actor/sampler_kl', 0):.2e}"
         + "".join(f"; {k.removeprefix('memory/')} {v:.1f} GiB" for k, v in r.items() if k.startswith("memory/")))
    return "\n".join(lines) + "\n"


class TimeLimit(BaseException):
    """SIGTERM, which scripts/gpu_check.sh's `timeout` sends at its limit: the running section is recorded as
    stopped and no other starts (a BaseException, so that no section's own `except Exception` takes it)."""

    @classmethod
    def raise_it(cls, signum: int, frame) -> None:
        raise cls("stopped by SIGTERM (the time limit) while this section ran")


def write_results(work: Path, result: dict) -> str:
    """gpu_suite.json and gpu_suite.md as they stand (after every section); returns the markdown."""
    (work / "gpu_suite.json").write_text(json.dumps(result, indent=1, default=str))
    try:
        table = markdown(result)
    except Exception as exc:  # a partial result the table cannot show: the json holds it
        table = f"(no table: {type(exc).__name__}: {exc}; see gpu_suite.json)"
    (work / "gpu_suite.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, runs on CPU in about a minute")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu_suite"), help="folder for gpu_suite.json/.md and logs")
    p.add_argument("--demo-steps", type=int, default=None, help="stub demo steps (default 200, --tiny 2)")
    p.add_argument("--timeout", type=int, default=900, help="seconds for each subprocess")
    p.add_argument("--big-cases", default="", help="comma list of bigmodel cases (default: "
                   f"{', '.join(c['name'] for c in BIG if not c.get('only_when_named'))}; also "
                   f"{', '.join(c['name'] for c in BIG if c.get('only_when_named'))})")
    args = p.parse_args(argv)
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.demo_steps = args.demo_steps or (2 if args.tiny else 200)
    args.big_cases = [c for c in args.big_cases.split(",") if c]
    shapes = TINY if args.tiny else FULL
    info = device_info()
    if not info["cuda"] and not args.tiny:
        p.error("no CUDA device: the full suite needs a GPU (use --tiny to run the same code paths on CPU)")
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, TimeLimit.raise_it)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "tiny": args.tiny,
              "date": time.strftime("%Y-%m-%d %H:%M"), "device": info, "shapes": dataclasses.asdict(shapes),
              "sections": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_suite_model_") as tmp:
        model_dir = None
        actor = None
        stopped = False
        for name in only:
            print(f"[gpu_suite] {name} ...", flush=True)
            start = time.perf_counter()
            try:
                if name in ("mfu", "mfu_compiled", "push", "step", "trl") and model_dir is None:
                    model_dir = write_model(shapes, Path(tmp))
                    args.model_dir = str(model_dir)
                if name == "tests":
                    out = section_tests(args, work)
                elif name == "demo":
                    out = section_demo(args, work)
                elif name in ("decode", "decode_layers"):
                    out = section_decode(args, work, shapes, info, layers=name == "decode_layers")
                elif name == "ring":
                    out = section_ring(shapes, info)
                elif name == "head":
                    out = section_head(shapes, info)
                elif name == "bigmodel":
                    actor = None  # the mfu section's actor: its memory is not this section's
                    gc.collect()
                    out = section_bigmodel(args, work, info)
                elif name == "mfu_compiled":
                    out = section_mfu_compiled(args, work, shapes, info, model_dir)
                elif name == "mfu":
                    out = section_mfu(args, work, shapes, info, model_dir)
                    actor = out.pop("_actor")
                elif name == "push":
                    if actor is None:
                        actor, _ = build_actor(model_dir, max(shapes.mfu_tokens), info)
                    out = section_push(args, work, info, actor)
                else:  # step, trl, moe, vlm
                    actor = None  # the trainer runs in its own process: give it this one's GPU memory
                    gc.collect()
                    if info["cuda"]:
                        import torch

                        torch.cuda.empty_cache()
                    out = (section_step(args, work, shapes, model_dir) if name == "step" else
                           section_trl(args, work, shapes, model_dir, info) if name == "trl" else
                           section_moe(args, work, shapes) if name == "moe" else section_vlm(args, work, shapes))
            except Exception as exc:  # one section's failure is recorded; the others still run
                traceback.print_exc()
                out = {"error": f"{type(exc).__name__}: {exc}"}
            except TimeLimit as exc:  # recorded, and no section starts after it
                out, stopped = {"error": str(exc)}, True
            out["section_s"] = time.perf_counter() - start
            result["sections"][name] = out
            print(f"[gpu_suite] {name}: {json.dumps(out, default=str)[:400]}", flush=True)
            # After every section: a run stopped by a time limit still leaves what it measured.
            write_results(work, result)
            if stopped:
                break
        del actor
    from train.parallel.distributed import cleanup

    cleanup()
    print(write_results(work, result))
    failed = [n for n, r in result["sections"].items() if "error" in r]
    if failed:
        print(f"[gpu_suite] failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
