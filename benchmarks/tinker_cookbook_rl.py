"""Run tinker-cookbook's own RL loop, unchanged, against a local Tinker server with the stub model.

    # 1. the Tinker server (its own terminal; the cookbook sends base_model = the stub's absolute path)
    .venv/bin/python -m train.tinker_service --base-model stub=stub/model --port 8100 \
        --root /tmp/tinker_service --api-key tml-local
    # 2. the cookbook's loop against it (the script sets TINKER_API_KEY=tml-local unless set)
    .venv/bin/python benchmarks/tinker_cookbook_rl.py --base-url http://127.0.0.1:8100 --steps 6 --eval-every 3
    .venv/bin/python benchmarks/tinker_cookbook_rl.py --base-url http://127.0.0.1:8100 --steps 200 --eval-every 20
    .venv/bin/python benchmarks/tinker_cookbook_rl.py --base-url http://127.0.0.1:8100 --loop rl_loop --steps 3

`--loop train` (default) calls `tinker_cookbook.rl.train.main(Config)` (the loop behind every cookbook
RL recipe) with the README demo's task expressed as a cookbook env: stub/data/math (two-digit
addition), reward = environments/eq.py's exact match of `<answer>N</answer>` (ProblemEnv with
format_coef=0, so reward == correct), 16 prompts x 8 samples, lr 1e-4, 12 new tokens. Besides the
cookbook's own `test/...` eval (temperature 1) it adds a greedy evaluator (`test_greedy/...`,
temperature 0). The README demo lifts the greedy test accuracy by > 0.2 in ~150 steps (full
fine-tune); a handful of steps only shows the plumbing works.

`--loop rl_loop` runs `tinker_cookbook/recipes/rl_loop.py`'s `main` (sync SDK, `num_samples=group_size`,
`stable_reinforce` with provenance) with three module globals swapped (its hub GSM8K load, its
model-name -> renderer lookup, its `\\boxed{}` reward). Its hard-coded few-shot prefix confuses the
stub, so the reward is a shaped plumbing signal, not a learning test.

The server must accept `base_model` = the stub's absolute path (default `--model-name`), answer
`get_info` for it, and treat temperature 0 as greedy. No file of the cookbook is edited.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import sys
import tempfile
import types
from functools import partial
from pathlib import Path

for _k, _v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
               ("TINKER_API_KEY", "tml-local")):  # the SDK refuses keys without the tml- prefix
    os.environ.setdefault(_k, _v)

import chz  # noqa: E402
from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.completers import TinkerTokenCompleter  # noqa: E402
from tinker_cookbook.rl import train  # noqa: E402
from tinker_cookbook.rl.metric_util import RLTestSetEvaluator  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STUB_MODEL = str(REPO / "stub" / "model")
MATH_DIR = str(REPO / "stub" / "data" / "math")
# The demo's reward function (environments/ is not a package: load the file).
_spec = importlib.util.spec_from_file_location("eq_env", REPO / "environments" / "eq.py")
eq_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eq_env)



def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------- the task as a cookbook env
class StubMathEnv(ProblemEnv):
    """One prompt of stub/data/math; reward 1 when eq.reward_fn says the reply is right."""

    def __init__(self, renderer: renderers.Renderer, messages: list[dict], answer: str):
        super().__init__(renderer, convo_prefix=messages[:-1], format_coef=0.0)
        self.question, self.answer = messages[-1]["content"], answer

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> bool:
        return eq_env.reward_fn([{"role": "assistant", "content": sample_str}], self.answer) == 1.0

    def check_format(self, sample_str: str) -> bool:
        return bool(eq_env.ANSWER.search(sample_str))

    def get_reference_answer(self) -> str:
        return self.answer


class ListDataset(RLDataset):
    def __init__(self, builders: list[EnvGroupBuilder], batch_size: int):
        self.builders, self.batch_size = builders, batch_size

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return self.builders[index * self.batch_size:(index + 1) * self.batch_size]

    def __len__(self) -> int:
        return len(self.builders) // self.batch_size


def make_dataset(path: str, model_name: str, renderer_name: str, group_size: int, batch_size: int | None,
                 limit: int | None = None, seed: int | None = None) -> ListDataset:
    rows = read_rows(path)
    if seed is not None:
        random.Random(seed).shuffle(rows)
    rows = rows[:limit]
    renderer = renderers.get_renderer(renderer_name, get_tokenizer(model_name))
    builders = [ProblemGroupBuilder(env_thunk=partial(StubMathEnv, renderer, r["messages"], r["answer"]),
                                    num_envs=group_size, dataset_name="stub_math") for r in rows]
    return ListDataset(builders, batch_size or len(builders))


@chz.chz
class StubMathDatasetBuilder(RLDatasetBuilder):
    model_name: str
    renderer_name: str
    batch_size: int = 16
    group_size: int = 8
    n_test: int = 64
    data_dir: str = MATH_DIR
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        train_ds = make_dataset(f"{self.data_dir}/train.jsonl", self.model_name, self.renderer_name,
                                self.group_size, self.batch_size, seed=self.seed)
        test_ds = make_dataset(f"{self.data_dir}/test.jsonl", self.model_name, self.renderer_name, 1, None,
                               limit=self.n_test)
        return train_ds, test_ds  # train.main adds RLTestSetEvaluator(test_ds) at temperature 1


class GreedyTestEvaluator(RLTestSetEvaluator):
    """The cookbook's test-set evaluator, sampling at temperature 0 (greedy)."""

    async def __call__(self, sampling_client, **kwargs):
        policy = TinkerTokenCompleter(sampling_client, max_tokens=self.max_tokens, temperature=0.0)
        return await self.eval_token_completer(policy, **kwargs)


def greedy_evaluator(args) -> GreedyTestEvaluator:
    ds = make_dataset(f"{MATH_DIR}/test.jsonl", args.model_name, args.renderer_name, 1, None, limit=args.n_test)
    return GreedyTestEvaluator(ds, max_tokens=args.max_tokens, name="test_greedy", num_groups_to_log=0)


# ---------------------------------------------------------------- the two loops
def run_train_loop(args) -> None:
    config = train.Config(
        base_url=args.base_url,
        model_name=args.model_name,
        renderer_name=args.renderer_name,
        recipe_name="infinite_rl_stub_math",
        log_path=args.log_path,
        dataset_builder=StubMathDatasetBuilder(model_name=args.model_name, renderer_name=args.renderer_name,
                                               batch_size=args.batch_size, group_size=args.group_size,
                                               n_test=args.n_test),
        evaluator_builders=[partial(greedy_evaluator, args)],
        learning_rate=args.lr,
        lora_rank=args.lora_rank,
        loss_fn=args.loss_fn,
        max_tokens=args.max_tokens,
        max_steps=args.steps,
        eval_every=args.eval_every,
        save_every=args.save_every,
        num_groups_to_log=1,
    )
    asyncio.run(train.main(config))


def run_rl_loop(args) -> None:
    import datasets
    from tinker_cookbook.recipes import rl_loop

    rows = [{"question": r["messages"][-1]["content"], "answer": f"#### {r['answer']}"}
            for r in read_rows(f"{MATH_DIR}/train.jsonl")]
    # rl_loop.main reads these three names from its module globals at call time.
    rl_loop.datasets = types.SimpleNamespace(
        DatasetDict=datasets.DatasetDict,
        load_dataset=lambda *a, **k: datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}))
    rl_loop.model_info = types.SimpleNamespace(get_recommended_renderer_name=lambda _name: args.renderer_name)

    def shaped_reward(response: str, answer: str) -> float:  # 1 if right, 0.1 per digit seen (max 0.5)
        want = answer.split("####")[-1].strip()
        if eq_env.reward_fn([{"role": "assistant", "content": response}], want):
            return 1.0
        return min(0.5, 0.1 * sum(c.isdigit() for c in response))
    rl_loop.get_reward = shaped_reward

    config = rl_loop.Config(base_url=args.base_url, log_path=args.log_path, model_name=args.model_name,
                            batch_size=args.batch_size, group_size=args.group_size, learning_rate=args.lr,
                            lora_rank=args.lora_rank, save_every=args.save_every, max_tokens=args.max_tokens,
                            loss_fn=args.rl_loop_loss_fn, max_steps=args.steps)
    rl_loop.main(config)


def print_metrics(log_path: str) -> None:
    """One compact line per step from the cookbook's metrics.jsonl."""
    path = Path(log_path) / "metrics.jsonl"
    if not path.exists():
        print(f"no {path}")
        return
    keys = [("env/all/reward/total", "reward"), ("env/all/correct", "correct"), ("reward/total", "reward"),
            ("test/env/all/correct", "test_T1"), ("test_greedy/env/all/correct", "test_greedy"),
            ("optim/kl_sample_train_v2", "kl_s_t"), ("time/total", "s")]
    print("\nper-step metrics (" + str(path) + ")")
    for line in path.read_text().splitlines():
        m = json.loads(line)
        shown = [f"{short}={m[k]:.4f}" for k, short in keys if isinstance(m.get(k), (int, float))]
        if shown:
            print(f"step {m.get('step', m.get('progress/batch', '?'))}: " + " ".join(shown))


def plot_curve(log_path: str, png: str) -> None:
    """The training reward per step and the greedy test accuracy at each eval, from the cookbook's metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (Path(log_path) / "metrics.jsonl").read_text().splitlines()]
    train_pts = [(m["step"], m["env/all/correct"]) for m in rows if "env/all/correct" in m]
    test_pts = [(m["step"], m["test_greedy/env/all/correct"]) for m in rows if "test_greedy/env/all/correct" in m]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train_pts), lw=0.8, alpha=0.6, label="train reward (temperature 1)")
    ax.plot(*zip(*test_pts), "o-", label="greedy test accuracy")
    ax.set(xlabel="step", ylabel="exact match", title="tinker-cookbook rl/train.py on train.tinker_service (stub)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="the local Tinker server, e.g. http://127.0.0.1:8000")
    p.add_argument("--loop", choices=["train", "rl_loop"], default="train")
    p.add_argument("--model-name", default=STUB_MODEL, help="base_model sent to the server; tokenizer path")
    p.add_argument("--renderer-name", default="qwen3_instruct",
                   help="qwen3_instruct (or qwen3) renders exactly the stub's ChatML template")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--loss-fn", default="importance_sampling",
                   help="train loop: importance_sampling | ppo | cispo | dro | stable_reinforce")
    p.add_argument("--rl-loop-loss-fn", default="importance_sampling",  # stable_reinforce: not served here
                   choices=["importance_sampling", "cispo", "gspo", "stable_reinforce"])
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--n-test", type=int, default=64)
    p.add_argument("--log-path", default=None, help="fresh dir (a dir with checkpoints.jsonl resumes)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the reward and greedy test curve here")
    args = p.parse_args()
    args.log_path = args.log_path or tempfile.mkdtemp(prefix=f"cookbook_{args.loop}_")
    print(f"log_path={args.log_path}", flush=True)
    (run_train_loop if args.loop == "train" else run_rl_loop)(args)
    print_metrics(args.log_path)
    if args.plot:
        plot_curve(args.log_path, args.plot)


if __name__ == "__main__":
    sys.exit(main())
