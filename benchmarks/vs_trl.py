"""Side-by-side GRPO throughput: TRL's GRPOTrainer against our trainer, in one run, on this machine.

    .venv/bin/python benchmarks/vs_trl.py                      # stub model, 1 process each
    .venv/bin/python benchmarks/vs_trl.py --nproc 2            # both under torchrun --nproc_per_node=2 (gloo)
    .venv/bin/python benchmarks/vs_trl.py --model path/to/smollm2-135m --steps 6 --warmup 1
    .venv/bin/python benchmarks/vs_trl.py --learning-curve --steps 300 --png curve.png   # seconds to a test reward
    .venv/bin/python benchmarks/vs_trl.py --device cuda --model DIR --max-new-tokens 128 --steps 4 --warmup 1  # 1 GPU

Both trainers get the same model, data, batch shape (prompts x responses per optimizer step), max new
tokens, sampling (temperature 1, no top-p/top-k), learning rate (constant, AdamW), gradient clip,
number of steps, seed, thread budget and reward (the env file's `reward_fn`, wrapped for TRL as a
reward function over the conversational completion). They run one after the other, each in its own
subprocess (torchrun for ours; plain python or torchrun for TRL), so they never share a process, a
core or memory. Step times exclude the first `--warmup` steps of each.

Ours: `time/step_s` (and the rollout / update / weight-sync phases) from `<save_dir>/metrics.jsonl`.
TRL: wall time between `on_step_begin` and `on_step_end` of a `TrainerCallback` (generation, reward,
loss forward/backward, clipping and the optimizer step), plus the time spent in
`_generate_and_score_completions` (generation + reward), measured by a thin subclass that only times it.

Nothing is downloaded: both trainers run with the Hugging Face libraries in offline mode.

`--device cuda` (one GPU, one process each; `benchmarks/gpu_suite.py --only trl` runs it on its 0.5B
shape): both keep float32 master weights and compute in bfloat16 (ours: `actor.dtype=bfloat16`, bf16 weights
cast from fp32 masters once per optimizer step, `actor.master_weights`, which its bf16 engine reads as they are,
`rollout.share_actor_base`; TRL: `bf16=True`, its own `transformers` generation), and both step timers
synchronize the GPU. The default (cpu) hides any GPU from both.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stub_runs import first_at, plot_curves

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `train` without an install too (a GPU image with the repository's folder only)
    sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------------------------------------
# helpers shared by the driver and the TRL worker
# ---------------------------------------------------------------------------------------------
def load_env_module(env_path: str):
    spec = importlib.util.spec_from_file_location(f"bench_env_{Path(env_path).stem}", env_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_trl_reward(env_path: str):
    """The env file's `reward_fn(messages, answer)` as a TRL reward function.

    TRL (conversational format) calls it with the batch's `prompts` (message lists), `completions`
    (each a list holding the assistant message) and every other dataset column as a keyword (here
    `answer`, stored JSON-encoded so any answer type fits one Arrow column)."""
    reward_fn = load_env_module(env_path).reward_fn

    def reward(prompts, completions, answer, **_):
        scores = []
        for prompt, completion, ans in zip(prompts, completions, answer):
            if isinstance(completion, str):
                completion = [{"role": "assistant", "content": completion}]
            value = reward_fn(list(prompt) + list(completion), json.loads(ans))
            if inspect.isawaitable(value):
                value = asyncio.run(value)
            scores.append(float(value))
        return scores

    reward.__name__ = Path(env_path).stem  # TRL logs rewards/<name>/mean
    return reward


def count_params(model_dir: str) -> int | None:
    try:
        from safetensors import safe_open
    except ImportError:
        return None
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                n = 1
                for d in h.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def offline_env(threads_per_proc: int, device: str = "cpu") -> dict[str, str]:
    from train.parallel.distributed import without_launcher_env

    # A caller that is itself a distributed process (gpu_suite.py after its push section) must not hand its
    # rank and rendezvous to a trainer started without torchrun: TRL's accelerate would join the caller's port.
    env = without_launcher_env(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads_per_proc),
        MKL_NUM_THREADS=str(threads_per_proc),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        WANDB_MODE="disabled",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    )
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark even where a GPU exists
    return env


# ---------------------------------------------------------------------------------------------
# the TRL side (runs in its own process, or processes under torchrun)
# ---------------------------------------------------------------------------------------------
def trl_worker(cfg_path: str) -> None:
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    torch.set_num_threads(cfg["threads_per_proc"])
    cuda = cfg.get("device", "cpu") == "cuda"
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from train.datasets.loading import load_rows

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    samples = cfg["prompts"] * cfg["responses"]

    rows = load_rows(cfg["data"])
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": json.dumps(r["answer"])} for r in rows])

    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name still works, with a warning)
    fields = getattr(GRPOConfig, "__dataclass_fields__", {})
    checkpointing_off = ({"activation_checkpointing": False} if "activation_checkpointing" in fields
                         else {"gradient_checkpointing": False})
    args = GRPOConfig(
        output_dir=cfg["work_dir"],
        # one optimizer step = one generation round of prompts x responses samples, all processes together
        per_device_train_batch_size=samples // world,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=cfg["responses"],
        num_iterations=1,
        max_completion_length=cfg["max_new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0,                      # no reference model (ours: actor.kl.coef=0)
        epsilon=0.2,                   # PPO clip (ours: actor.clip=0.2)
        loss_type="dapo",              # token mean over the whole batch (ours: all_token_mean)
        scale_rewards="group",         # divide by the group std (ours: adv.norm_var=true)
        learning_rate=cfg["lr"], lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        max_grad_norm=cfg["max_grad_norm"],
        max_steps=cfg["steps"],
        seed=cfg["seed"],
        use_cpu=not cuda, bf16=cuda, fp16=False,  # on a GPU: fp32 master weights, bf16 autocast (ours: actor.dtype=bfloat16)
        **checkpointing_off,           # GRPOConfig defaults to checkpointing on; ours is off
        ddp_backend="gloo" if world > 1 else None,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient; True costs an extra graph walk
        eval_strategy="no", save_strategy="no", report_to="none",
        logging_steps=1, disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)  # ours: actor.dtype=float32

    class Timer(TrainerCallback):
        def __init__(self):
            self.t0 = 0.0
            self.step_s: list[float] = []
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()  # the step's kernels, not only their launches
            self.step_s.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                self.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer unchanged, except that the generation + reward phase is timed."""
        generate_s: list[float] = []

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.generate_s.append(time.perf_counter() - start)
            return out

    class Evaluator(TrainerCallback):
        """--learning-curve: greedy test reward every `test_freq` steps (and before the first), outside
        the timed step: on_step_end runs after Timer's (callbacks run in order)."""

        def __init__(self):
            self.evals: list[tuple[int, float]] = []
            self.rows = load_rows(cfg["test_data"]) if cfg.get("test_freq") else []
            self.reward_fn = load_env_module(cfg["env"]).reward_fn

        @torch.no_grad()
        def score(self, model) -> float:
            was_training = model.training
            model.eval()
            tokenizer.padding_side = "left"
            total = 0.0
            for i in range(0, len(self.rows), 64):
                rows = self.rows[i:i + 64]
                texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
                         for r in rows]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, max_new_tokens=cfg["max_new_tokens"], do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
                for r, ids in zip(rows, out[:, enc["input_ids"].shape[1]:]):
                    reply = tokenizer.decode(ids, skip_special_tokens=True)
                    total += float(self.reward_fn(r["messages"] + [{"role": "assistant", "content": reply}],
                                                  r["answer"]))
            model.train(was_training)
            return total / max(len(self.rows), 1)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if self.rows and int(os.environ.get("RANK", "0")) == 0:
                self.evals.append((0, self.score(model)))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if self.rows and state.global_step % cfg["test_freq"] == 0 and int(os.environ.get("RANK", "0")) == 0:
                self.evals.append((state.global_step, self.score(model)))

    timer, evaluator = Timer(), Evaluator()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=make_trl_reward(cfg["env"]), args=args,
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[timer, evaluator])
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    if trainer.accelerator.is_main_process:
        train_logs = [l for l in timer.logs if "loss" in l or "reward" in l]
        Path(cfg["result"]).write_text(json.dumps({
            "step_s": timer.step_s,
            "generate_s": TimedGRPOTrainer.generate_s,
            "rewards": [l.get("reward") for l in train_logs],
            "response_length": [l.get("completions/mean_length") for l in train_logs],
            "train_s": train_s,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "generation_batch_size": args.generation_batch_size,
            "world_size": world,
            "torch_threads": torch.get_num_threads(),
            "evals": evaluator.evals,
        }))


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------
def cpu_busy_s() -> float | None:
    """CPU seconds all processes on the machine have spent busy so far (Linux /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def launch(cmd: list[str], env: dict, log_path: Path, timeout_s: int) -> tuple[float, float | None]:
    """Run one trainer; return its wall time and the mean number of cores that *other* processes
    kept busy meanwhile (machine busy time minus this run's own CPU time), a check on contention."""
    busy0, own0, start = cpu_busy_s(), children_cpu_s(), time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    wall = time.perf_counter() - start
    busy1, own1 = cpu_busy_s(), children_cpu_s()
    if proc.returncode != 0:
        tail = log_path.read_text()[-4000:]
        raise SystemExit(f"command failed (exit {proc.returncode}): {' '.join(cmd)}\n--- log tail ---\n{tail}")
    others = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    return wall, others


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run_ours(a, work: Path, threads_per_proc: int) -> dict:
    save_dir = work / "ours"
    if a.rollout_ranks:  # the same cores over more processes: trainer ranks and dedicated rollout ranks
        threads_per_proc = max(1, a.threads // (a.nproc + a.rollout_ranks))
    cmd = torchrun(a.nproc + a.rollout_ranks) + [
        "-m", "train.trainer.grpo", "--config-name", "stub",
        f"actor.model_name={a.model}", f"data.train_data_path={a.data}", f"rollout.env_path={a.env}",
        f"data.prompts_per_rollout={a.prompts}", f"data.responses_per_prompt={a.responses}",
        f"rollout.train_sampling_params.max_new_tokens={a.max_new_tokens}",
        "rollout.train_sampling_params.temperature=1.0", "rollout.train_sampling_params.top_p=1.0",
        "rollout.train_sampling_params.top_k=-1",
        f"actor.lr={a.lr!r}", f"actor.max_grad_norm={a.max_grad_norm!r}", "actor.scheduler=constant",
        "actor.warmup_ratio=0.0", "actor.weight_decay=0.0", "actor.kl.coef=0.0", "actor.clip=0.2",
        "actor.agg_mode=all_token_mean", "adv.norm_var=true",
        f"actor.dtype={'bfloat16' if a.device == 'cuda' else 'float32'}",
        # on a GPU the micro-batch and the recompute from free memory, the defaults there (TRL runs its whole batch
        # in one forward, without checkpointing); on CPU the stub config's 8,192-token packs
        *(["actor.max_length_per_device=null", "actor.gradient_checkpointing=null"] if a.device == "cuda" else []),
        "rollout.dynamic_filtering=false",
        f"trainer.total_steps={a.steps}", f"trainer.test_freq={a.test_freq if a.learning_curve else 'null'}",
        f"data.test_data_path={a.test_data}", f"rollout.test_sampling_params.max_new_tokens={a.max_new_tokens}",
        f"rollout.max_staleness={a.max_staleness}", f"actor.share_prompt={a.share_prompt}", "trainer.save_freq=null",
        "trainer.progress_bar=false", f"trainer.save_dir={save_dir}", f"trainer.num_threads={threads_per_proc}",
        f"trainer.seed={a.seed}", f"rollout.ranks={a.rollout_ranks}",
    ]
    wall, others = launch(cmd, offline_env(threads_per_proc, a.device), work / "ours.log", a.timeout)
    all_rows = [json.loads(l) for l in (save_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    rows = [r for r in all_rows if "time/step_s" in r]
    if len(rows) != a.steps:
        raise SystemExit(f"ours logged {len(rows)} steps, expected {a.steps} (see {work / 'ours.log'})")
    return {
        "step_s": [r["time/step_s"] for r in rows],
        "rollout_s": [r.get("time/rollout_s", 0.0) for r in rows],
        "update_s": [r.get("time/update_s", 0.0) for r in rows],
        "weight_sync_s": [r.get("time/weight_sync_s", 0.0) for r in rows],
        "rewards": [r.get("rewards/train") for r in rows],
        "response_length": [r.get("response_length/train") for r in rows],
        "trajectory_length": [r.get("trajectory_length/train") for r in rows],
        "evals": [(0, r0["rewards/test"]) for r0 in all_rows if r0["step"] == 0 and "rewards/test" in r0]
                 + [(r["step"], r["rewards/test"]) for r in rows if "rewards/test" in r],
        "wall_s": wall,
        "other_processes_cores": others,
    }


def run_trl(a, work: Path, threads_per_proc: int) -> dict:
    cfg_path, result = work / "trl_config.json", work / "trl_result.json"
    cfg_path.write_text(json.dumps({
        "model": a.model, "data": a.data, "env": a.env, "prompts": a.prompts, "responses": a.responses,
        "max_new_tokens": a.max_new_tokens, "lr": a.lr, "max_grad_norm": a.max_grad_norm, "steps": a.steps,
        "seed": a.seed, "threads_per_proc": threads_per_proc, "work_dir": str(work / "trl"), "result": str(result),
        "test_data": a.test_data, "test_freq": a.test_freq if a.learning_curve else 0, "device": a.device,
    }))
    script = [str(Path(__file__).resolve()), "--trl-worker", str(cfg_path)]
    cmd = (torchrun(a.nproc) if a.nproc > 1 else [sys.executable]) + script
    wall, others = launch(cmd, offline_env(threads_per_proc, a.device), work / "trl.log", a.timeout)
    out = json.loads(result.read_text())
    if len(out["step_s"]) != a.steps:
        raise SystemExit(f"TRL timed {len(out['step_s'])} steps, expected {a.steps} (see {work / 'trl.log'})")
    out["wall_s"] = wall
    out["other_processes_cores"] = others
    return out


def matmul_peak_gflops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate with `threads` threads (the best of a few n^3 products)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(before)
    return 2 * n**3 / best / 1e9


def active_body_params(c) -> float:
    """Parameters a token goes through in the decoder layers (the MFU's "6 x params"): attention projections and
    the MLP; for a mixture of experts only the router and its top-k experts (plus a shared expert), not all of
    them (Qwen3-30B-A3B: ~3B active of 30B)."""
    from train.parallel.tensor_parallel import expert_count

    h, layers = c.hidden_size, c.num_hidden_layers
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    attention = h * heads * head_dim * 2 + h * kv * head_dim * 2
    experts = expert_count(c)
    dense_mlp = 3 * h * c.intermediate_size
    if not experts:
        return layers * (attention + dense_mlp)
    expert_width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    moe_mlp = h * experts + c.num_experts_per_tok * 3 * h * expert_width  # router + the experts each token uses
    moe_mlp += 3 * h * (getattr(c, "shared_expert_intermediate_size", None) or 0)
    dense_layers = len(getattr(c, "mlp_only_layers", None) or [])  # Qwen3-MoE: layers with a dense MLP
    return layers * attention + dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp


def update_gflop(model_dir: str, samples: int, tokens_per_sample: float, action_tokens_per_sample: float) -> float:
    """FLOPs of one update (forward + backward): 6 x active body parameters x tokens (active_body_params: a
    mixture of experts counts its top-k experts), the LM head only on action tokens (as ours runs it), and
    causal attention scores and values, 6 x L^2 x hidden per layer and sequence (L the mean sequence length)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    body = active_body_params(c)
    tokens = samples * tokens_per_sample
    flops = 6 * body * tokens + 6 * vocab * h * samples * action_tokens_per_sample
    flops += 6 * layers * h * samples * tokens_per_sample**2
    return flops / 1e9


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def summarize(raw: dict, warmup: int, samples: int, phases: dict[str, str]) -> dict:
    timed = raw["step_s"][warmup:]
    step = statistics.fmean(timed)
    out = {
        "step_s_mean": step,
        "step_s_median": statistics.median(timed),
        "step_s_stdev": statistics.stdev(timed) if len(timed) > 1 else 0.0,
        "samples_per_s": samples / step,
        "reward_mean": mean(raw.get("rewards", [])),
        "response_length_mean": mean(raw.get("response_length", [])),
        "wall_s": raw["wall_s"],
        "other_processes_cores": raw.get("other_processes_cores"),
    }
    for name, key in phases.items():
        if raw.get(key):
            out[name] = statistics.fmean(raw[key][warmup:])
    return out


def wait_for_idle(max_wait_s: int, name: str) -> None:
    busy = busy_cores_now()
    deadline = time.monotonic() + max_wait_s
    while busy is not None and busy > 0.2 and time.monotonic() < deadline:
        print(f"waiting for the CPU to go idle ({busy:.2f} cores busy) ...", flush=True)
        time.sleep(10)
        busy = busy_cores_now()
    if busy is not None and busy > 0.2:
        print(f"warning: {busy:.2f} cores busy before the {name} run: other processes share the CPU, "
              "timings will be noisy", flush=True)


def busy_cores_now(window_s: float = 1.0) -> float | None:
    """Cores kept busy by the machine over the next `window_s` (this process sleeps meanwhile)."""
    b0 = cpu_busy_s()
    time.sleep(window_s)
    b1 = cpu_busy_s()
    return None if b0 is None or b1 is None else (b1 - b0) / window_s


def fmt(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="stub/model", help="local HF model folder (never downloaded)")
    p.add_argument("--data", default="stub/data/math/train.jsonl")
    p.add_argument("--env", default="environments/eq.py", help="env file whose reward_fn both trainers use")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps of each trainer left out of the means")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (all processes together)")
    p.add_argument("--responses", type=int, default=8, help="responses per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--nproc", type=int, default=1, help="processes per trainer (torchrun, gloo)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: one GPU, bf16 compute with fp32 master weights for both (see the module docstring)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="total CPU threads per trainer, split evenly over its processes")
    p.add_argument("--only", choices=["both", "ours", "trl"], default="both")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per trainer run")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the pair this many times, alternating; each trainer's fastest round is reported")
    p.add_argument("--wait-idle", type=int, default=0,
                   help="before each trainer, wait up to this many seconds for other processes to leave the CPU")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--learning-curve", action="store_true",
                   help="also evaluate greedily on --test-data every --test-freq steps (outside the timed steps) and "
                        "report the training seconds each trainer needs to reach --target")
    p.add_argument("--test-data", default="stub/data/math/test.jsonl")
    p.add_argument("--test-freq", type=int, default=25)
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--max-staleness", type=int, default=0, help="ours: rollout.max_staleness")
    p.add_argument("--rollout-ranks", type=int, default=0,
                   help="ours: rollout.ranks (dedicated rollout processes besides --nproc trainer processes; "
                        "--threads is then split over all of ours)")
    p.add_argument("--share-prompt", choices=["true", "false"], default="true",
                   help="ours: actor.share_prompt (each group's prompt laid out once in the training passes)")
    p.add_argument("--png", default=None, help="--learning-curve: test reward against training seconds, both trainers")
    p.add_argument("--keep", action="store_true", help="keep the run folders and logs")
    a = p.parse_args()

    for name in ("model", "data", "env", "test_data"):
        path = Path(getattr(a, name))
        path = path if path.is_absolute() else REPO / path
        if not path.exists():
            raise SystemExit(f"--{name} {getattr(a, name)!r} not found (this benchmark never downloads)")
        setattr(a, name, str(path))
    if a.steps <= a.warmup:
        raise SystemExit("--steps must be larger than --warmup")
    if (a.prompts * a.responses) % a.nproc or a.prompts % a.nproc:
        raise SystemExit("--prompts (and prompts x responses) must divide evenly over --nproc")
    if a.responses < 2:
        raise SystemExit("TRL needs --responses >= 2")
    if a.device == "cuda" and a.nproc != 1:
        raise SystemExit("--device cuda runs one process per trainer on one GPU: use --nproc 1")
    threads_per_proc = max(1, a.threads // a.nproc)
    samples = a.prompts * a.responses

    import torch
    import transformers
    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        if a.only != "ours":
            raise SystemExit("trl is not installed: pip install -r requirements-bench.txt")
        trl_version = None

    n_params = count_params(a.model)
    settings = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {os.cpu_count()} CPU cores",
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl_version,
        "model": os.path.relpath(a.model, REPO), "params": n_params, "data": os.path.relpath(a.data, REPO),
        "env": os.path.relpath(a.env, REPO), "prompts": a.prompts, "responses": a.responses,
        "samples_per_step": samples, "max_new_tokens": a.max_new_tokens, "lr": a.lr,
        "max_grad_norm": a.max_grad_norm, "steps": a.steps, "warmup": a.warmup, "seed": a.seed,
        "nproc": a.nproc, "threads_per_proc": threads_per_proc, "OMP_NUM_THREADS": threads_per_proc,
        "ours_max_staleness": a.max_staleness, "ours_rollout_ranks": a.rollout_ranks,
    }
    print("settings: " + " ".join(f"{k}={v}" for k, v in settings.items()), flush=True)

    work = Path(tempfile.mkdtemp(prefix="vs_trl_"))
    results: dict = {"settings": settings}
    names = [n for n in ("ours", "trl") if a.only in ("both", n)]
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for r in range(a.rounds):
            for name in names:  # one trainer at a time, alternating when --rounds > 1
                wait_for_idle(a.wait_idle, name)
                tag = f" round {r + 1}/{a.rounds}" if a.rounds > 1 else ""
                print(f"running {name}{tag} ({a.steps} steps, {a.nproc} process(es)) ...", flush=True)
                run_dir = work / f"round{r + 1}"
                run_dir.mkdir(exist_ok=True)
                raw = (run_ours if name == "ours" else run_trl)(a, run_dir, threads_per_proc)
                if (raw.get("other_processes_cores") or 0.0) > 0.2:
                    print(f"warning: other processes kept {raw['other_processes_cores']:.2f} cores busy during "
                          f"the {name} run", flush=True)
                phases = ({"rollout_s_mean": "rollout_s", "update_s_mean": "update_s",
                           "weight_sync_s_mean": "weight_sync_s"} if name == "ours"
                          else {"generate_s_mean": "generate_s"})
                summary = summarize(raw, a.warmup, samples, phases)
                rounds[name].append({"summary": summary, "raw": raw})
                print(f"  done in {raw['wall_s']:.1f} s wall (incl. start-up), {summary['step_s_mean']:.3f} s/step",
                      flush=True)
    finally:
        if a.keep:
            print(f"run folders and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for name in names:  # with several rounds, each trainer's fastest round (the least disturbed) is reported
        best = min(rounds[name], key=lambda x: x["summary"]["step_s_mean"])
        results[name] = best["summary"]
        results[name + "_rounds"] = rounds[name]

    ours, trl_res = results.get("ours"), results.get("trl")
    if ours and trl_res:
        results["ratio_samples_per_s_ours_over_trl"] = ours["samples_per_s"] / trl_res["samples_per_s"]
    if ours and a.device == "cpu":  # the update's FLOP/s against this CPU's matmul peak (gpu_suite: the GPU's MFU)
        raw = min(rounds["ours"], key=lambda x: x["summary"]["step_s_mean"])["raw"]
        traj, resp = mean(raw["trajectory_length"][a.warmup:]), mean(raw["response_length"][a.warmup:])
        if traj and resp and ours.get("update_s_mean"):
            gflop = update_gflop(a.model, samples, traj, resp)
            peak = matmul_peak_gflops(threads_per_proc * a.nproc)
            results["efficiency"] = {"update_gflop": gflop, "update_gflops": gflop / ours["update_s_mean"],
                                     "matmul_peak_gflops": peak,
                                     "fraction_of_peak": gflop / ours["update_s_mean"] / peak}
    print_table(results, a.rounds)
    if a.learning_curve:
        results["learning_curve"] = learning_curves(rounds, a)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {a.out}")


def learning_curves(rounds: dict[str, list[dict]], a) -> dict:
    """Per trainer (first round): (step, training seconds so far, greedy test reward) at each
    evaluation, and the training seconds to the first evaluation at or above `a.target`."""
    out = {}
    for name, runs in rounds.items():
        raw = runs[0]["raw"]
        elapsed = [0.0]
        for t in raw["step_s"]:
            elapsed.append(elapsed[-1] + t)
        points = [(step, elapsed[step], reward) for step, reward in raw.get("evals", [])]
        hit = first_at(points, a.target)
        out[name] = {"points": points, "target_step": hit[0] if hit else None, "target_s": hit[1] if hit else None}
    print(f"\nlearning curve: greedy test reward on {os.path.relpath(a.test_data, REPO)} every {a.test_freq} steps, "
          f"training seconds = the sum of the timed steps (evaluation excluded), target {a.target}")
    print("| trainer | step s | first evaluation >= target | training s to target | last test reward |")
    print("|---|---|---|---|---|")
    for name, c in out.items():
        points = c["points"]
        mean_step = points[-1][1] / max(points[-1][0], 1) if points else float("nan")
        print(f"| {name} | {mean_step:.3f} | {c['target_step'] if c['target_step'] is not None else 'not reached'} | "
              f"{fmt(c['target_s'], '.1f')} | {fmt(points[-1][2] if points else None)} |")
    if out.get("ours", {}).get("target_s") and out.get("trl", {}).get("target_s"):
        print(f"training seconds to {a.target}: ours / TRL = {out['ours']['target_s'] / out['trl']['target_s']:.2f}")
    if a.png:
        plot_curves({name: c["points"] for name, c in out.items()}, a.target, a.png)
    return out


def print_table(results: dict, n_rounds: int = 1) -> None:
    s = results["settings"]
    ours, trl_res = results.get("ours") or {}, results.get("trl") or {}
    params = f"{s['params'] / 1e6:.1f}M params" if s.get("params") else "? params"
    print()
    print(f"GRPO, {s['model']} ({params}), {s['prompts']} prompts x {s['responses']} responses = "
          f"{s['samples_per_step']} samples/step, max_new_tokens={s['max_new_tokens']}, lr={s['lr']:g}, "
          f"{s['steps']} steps (first {s['warmup']} excluded), nproc={s['nproc']}, "
          f"threads/proc={s['threads_per_proc']}")
    if n_rounds > 1:
        for name, label in (("ours", "ours"), ("trl", "TRL")):
            if results.get(name + "_rounds"):
                means = ", ".join(f"{x['summary']['step_s_mean']:.3f}" for x in results[name + "_rounds"])
                print(f"{label} s/step per round: {means} (fastest reported)")
    rows = [
        ("samples/s", "samples_per_s", ".1f"),
        ("step s (mean)", "step_s_mean", ".3f"),
        ("step s (median)", "step_s_median", ".3f"),
        ("step s (stdev)", "step_s_stdev", ".3f"),
        ("mean train reward", "reward_mean", ".3f"),
        ("mean response tokens", "response_length_mean", ".2f"),
        ("wall s (incl. start-up)", "wall_s", ".1f"),
        ("others' CPU use (cores)", "other_processes_cores", ".2f"),
    ]
    print(f"| {'metric':<24} | {'ours':>9} | {'TRL':>9} |")
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 11}|")
    for label, key, spec in rows:
        print(f"| {label:<24} | {fmt(ours.get(key), spec):>9} | {fmt(trl_res.get(key), spec):>9} |")
    if "ratio_samples_per_s_ours_over_trl" in results:
        print(f"throughput ratio ours/TRL: {results['ratio_samples_per_s_ours_over_trl']:.2f}x "
              "(>1: ours is faster)")
    if ours:
        print(f"ours per step: rollout {fmt(ours.get('rollout_s_mean'))} s, update {fmt(ours.get('update_s_mean'))} s, "
              f"weight sync {fmt(ours.get('weight_sync_s_mean'), '.4f')} s")
    if trl_res and trl_res.get("generate_s_mean") is not None:
        rest = trl_res["step_s_mean"] - trl_res["generate_s_mean"]
        print(f"TRL per step:  generate+reward {trl_res['generate_s_mean']:.3f} s, "
              f"loss/backward/optimizer {rest:.3f} s")
    eff = results.get("efficiency")
    if eff:
        print(f"ours update: {eff['update_gflop']:.1f} GFLOP per step (6 x params x tokens, LM head on action tokens, "
              f"attention) = {eff['update_gflops']:.1f} GFLOP/s, {100 * eff['fraction_of_peak']:.0f}% of this "
              f"machine's fp32 matmul peak ({eff['matmul_peak_gflops']:.1f} GFLOP/s, same threads)")


if __name__ == "__main__":
    main()
