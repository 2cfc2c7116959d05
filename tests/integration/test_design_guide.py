"""The design guide's three commands, copied as written, run to completion on this CPU. Only the
model (a Hub id from an offline cache in the Hub's layout, stub/model, or stub/tool_model for the
launch command with tools), --nproc_per_node, a step limit (`trainer.total_steps`) and how many
samples are logged change. Each runs in a fresh working directory holding links to
`environments/` and `stub/`, so the guide's relative paths work and `ckpts/` lands there."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, STUB_HUB_ID, read_jsonl, run_torchrun, trainer_env

LAUNCH = r"""torchrun --nproc_per_node=8 -m train.trainer.grpo \
  'data.train_data_path="verifiers:train?limit=32"' 'data.test_data_path="verifiers:eval?limit=32"' \
  data.prompts_per_rollout=8 data.responses_per_prompt=4 actor.model_name=Qwen/Qwen2-1.5B-Instruct \
  actor.max_length_per_device=512 rollout.train_sampling_params.max_new_tokens=128 \
  rollout.env_path=environments/verifiers_adapter.py rollout.max_turns=3 adv.estimator=reinforce adv.norm_var=true \
  trainer.project=GRPO trainer.experiment_name=grpo-math-verifiers-integration trainer.use_wandb=true \
  trainer.n_epochs=1 trainer.test_freq=999999 trainer.save_freq=null"""

WIRE_UP = ("rollout.env_path=environments/verifiers_math.py rollout.model_name=<your_model_path_or_name> "
           "data.train_data_path=stub/data/math/train.jsonl data.test_data_path=stub/data/math/test.jsonl "
           "data.prompts_per_rollout=4 data.responses_per_prompt=2")

SMOKE = ("python -m train.trainer.grpo --config-name grpo rollout.env_path=environments/eq.py "
         "rollout.model_name=<your_model> data.train_data_path=stub/data/math/train.jsonl "
         "data.test_data_path=stub/data/math/test.jsonl data.prompts_per_rollout=2 data.responses_per_prompt=2 "
         "trainer.n_epochs=1 trainer.test_freq=999999 trainer.save_dir=ckpts/math_stub")

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


@pytest.fixture
def workdir(tmp_path, stub_hub_cache):
    for name in ("environments", "stub"):
        os.symlink(ROOT / name, tmp_path / name)
    return tmp_path, {"HF_HUB_CACHE": str(stub_hub_cache), "PYTHONPATH": str(ROOT)}


def words(command: str, **replace: str) -> list[str]:
    out = []
    for word in shlex.split(command.replace("\\\n", " ")):  # a shell's line continuations
        for old, new in replace.items():
            word = word.replace(old, new)
        out.append(word)
    return out


def check_run(run_dir, steps: int) -> list[dict]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics if "rewards/train" in m] == list(range(1, steps + 1))
    assert all(m["trajectory_length/train"] > m["prompt_length/train"] > 0 for m in metrics if "rewards/train" in m)
    assert (run_dir / "latest" / "model.safetensors").exists()
    return metrics


@pytest.mark.slow
def test_launch_command(workdir) -> None:
    """With the shipped tool-calling stub (stub/tool_model) the taskset's python tool is really
    called: tool calls and the sandbox's replies are in trajectories.jsonl and the tools/* metrics."""
    cwd, env = workdir
    cmd = words(LAUNCH, **{"Qwen/Qwen2-1.5B-Instruct": "stub/tool_model", "--nproc_per_node=8": "--nproc_per_node=2"})
    assert cmd[0] == "torchrun"
    # trainer.log_samples only widens what is logged, so that the check below sees every sample
    proc = run_torchrun(TORCHRUN + cmd[1:] + ["trainer.total_steps=2", "trainer.log_samples=16"], timeout=600,
                        cwd=cwd, env={**env, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run_dir = cwd / "ckpts" / "grpo-math-verifiers-integration"  # trainer.save_dir from the experiment name
    metrics = check_run(run_dir, 2)
    assert [m["step"] for m in metrics if "rewards/test" in m] == [0, 2]
    assert all(m.get("env/errors", 0) == 0 for m in metrics)
    samples = [e for e in read_jsonl(run_dir / "trajectories.jsonl") if e["type"] == "sample"]
    assert samples and all("verifiers_task" in s["messages"][0] for s in samples)
    assert all(m["tools/calls_per_sample"] > 0 and m["tools/call_rate"] > 0 for m in metrics if "rewards/train" in m)
    ran = []  # (sample, the call's two operands and operator, the sandbox's reply)
    for s in samples:
        for call, reply in zip(s["messages"], s["messages"][1:]):
            code = re.search(r'"code": "print\((\d+) ([+*]) (\d+)\)"', call["content"] if call["role"] == "assistant" else "")
            if code and reply["role"] == "tool" and not reply["error"]:
                ran.append((s, code.groups(), reply["content"]))
    assert ran, "no logged conversation has a python call answered by the sandbox"
    sample, (a, op, b), reply = ran[0]
    assert reply == str(int(a) + int(b) if op == "+" else int(a) * int(b))  # the sandbox ran the model's code
    assert [e["type"] for e in sample["events"]][:1] == ["tool"]
    assert any((run_dir / "wandb").glob("offline-run-*")), "wandb (offline) logged nothing"


@pytest.mark.slow
def test_minimal_environment_wire_up(workdir) -> None:
    cwd, env = workdir
    cmd = ["-m", "train.trainer.grpo", *words(WIRE_UP, **{"<your_model_path_or_name>": STUB_HUB_ID}),
           "trainer.total_steps=2"]
    proc = run_torchrun(TORCHRUN + ["--nproc_per_node=2"] + cmd, timeout=600, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    check_run(cwd / "ckpts" / "grpo", 2)  # the default experiment name


@pytest.mark.slow
def test_single_gpu_smoke_test_runs_as_one_plain_process(workdir) -> None:
    cwd, env = workdir
    cmd = words(SMOKE, **{"<your_model>": "stub/model"})
    assert cmd[:3] == ["python", "-m", "train.trainer.grpo"]
    full = {**trainer_env(), **env}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(var, None)
    proc = subprocess.run([sys.executable, *cmd[1:], "trainer.total_steps=2"], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "1 ranks on 1 node(s)" in proc.stdout + proc.stderr
    # config/grpo.yaml leaves the micro-batch, checkpointing and the fused head null: decided, and said, at start
    assert ("actor memory settings: on cpu: max_length_per_device 4096, gradient_checkpointing off, fused head off"
            in proc.stdout + proc.stderr)
    config = (cwd / "ckpts" / "math_stub" / "config.yaml").read_text()
    assert "model_name: stub/model" in config  # the actor started from rollout.model_name
    check_run(cwd / "ckpts" / "math_stub", 2)
