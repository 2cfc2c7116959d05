"""rollout.sleep in trainer runs (train/trainer/engine_sleep.py): the setting reaches the step, which says what it
decided and records it (`engine/slept`); on a GPU an engine kept awake keeps its CUDA graphs from step to step,
where a sleeping one captures them again after every update."""
import pytest
import torch

from conftest import read_jsonl, run_trainer


COMMON = ["trainer.test_freq=null", "trainer.save_freq=null"]


def test_an_engine_told_not_to_sleep_stays_awake_and_the_run_says_so(tmp_path):
    proc = run_trainer([f"trainer.save_dir={tmp_path}", "trainer.total_steps=2", "rollout.sleep=false", *COMMON])
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "engine/slept" in r]
    assert [r["engine/slept"] for r in rows] == [0.0, 0.0]
    assert all("time/engine_sleep_s" not in r and r["time/engine_wake_s"] >= 0 for r in rows)
    assert "the engine stays awake through the update" in proc.stdout + proc.stderr
    events = [e for e in read_jsonl(tmp_path / "trajectories.jsonl") if e["type"] == "engine_sleep"]
    assert len(events) == 1 and events[0]["step"] == 1 and "rollout.sleep=false" in events[0]["line"]


@pytest.mark.gpu  # benchmarks/gpu_suite.py's `tests` section runs it
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_on_a_gpu_null_keeps_a_small_runs_engine_and_its_graphs_awake(tmp_path):
    """The stub on one GPU (the update's plan is a few MiB): null keeps the engine awake, and its CUDA graphs
    are captured once; told to sleep, it captures them again at every step."""
    runs = {}
    for sleep in ("null", "true"):
        proc = run_trainer([f"trainer.save_dir={tmp_path / sleep}", "trainer.total_steps=2", f"rollout.sleep={sleep}",
                            "rollout.compile_decode=false", *COMMON])
        runs[sleep] = ([r for r in read_jsonl(tmp_path / sleep / "metrics.jsonl") if "engine/slept" in r],
                       proc.stdout + proc.stderr)
    awake, asleep = runs["null"][0], runs["true"][0]
    assert [r["engine/slept"] for r in awake] == [0.0] * 2 and [r["engine/slept"] for r in asleep] == [1.0] * 2
    assert "the engine stays awake through the update" in runs["null"][1]
    graphs_awake, graphs_asleep = [r["engine/cuda_graphs"] for r in awake], [r["engine/cuda_graphs"] for r in asleep]
    assert graphs_asleep[0] > 0 and all(b > a for a, b in zip(graphs_asleep, graphs_asleep[1:])), graphs_asleep
    assert graphs_awake[-1] < graphs_asleep[-1], (graphs_awake, graphs_asleep)
    assert all(r["time/engine_sleep_s"] > 0 for r in asleep)
    # what it owns in one page-locked slab, reported each step: here the rotary buffers, one page (it borrows the
    # actor's bf16 weights, rollout.share_actor_base=null), at most the stub's 0.8M parameters in bf16
    assert all(0 < r["memory/engine_host_gib"] < 0.01 for r in asleep) and "memory/engine_host_gib" not in awake[0]


PLANNED = r"""
import json, sys, torch
from omegaconf import OmegaConf
from train.models.actor import Actor
from train.models.critic import Critic
from train.parallel.distributed import init_distributed

ctx = init_distributed()
cfg = OmegaConf.load("config/grpo.yaml")
for section in (cfg.actor, cfg.critic):
    section.model_name, section.max_length_per_device, section.gradient_checkpointing = "stub/model", 512, False
cfg.actor.use_liger_kernel = False
actor = Actor(cfg.actor, ctx, "stub/model", pad_token_id=0, train=True, temperature=1.0)
critic = Critic(cfg.critic, ctx, "stub/model", pad_token_id=0)
reference = Actor(cfg.actor, ctx, "stub/model", pad_token_id=0, train=False, temperature=1.0)
out = {"cpu": [m.update_working_bytes() for m in (actor, critic)]}
for m in (actor, critic, reference):
    m.device = torch.device("cuda")  # only read as the device's type: the plan is arithmetic on shapes
out["before"] = [m.update_working_bytes() for m in (actor, critic, reference)]
for m in (actor, critic):
    m.optimizer.state[next(iter(m.optimizer.param_groups[0]["params"]))] = {"step": 1}  # as after a first step
out["after"] = [m.update_working_bytes() for m in (actor, critic)]
out["short"] = actor.update_working_bytes(300)  # a step batch of 300 tokens over all ranks: no longer pack
print(json.dumps(out))
"""


def test_the_actor_and_the_critic_say_what_their_update_will_take(in_repo_root):
    """Trainable.update_working_bytes on the built models (the attributes the GPU reads are there): none on a CPU
    or for a model that does not train; on a GPU the plan at the longer of the update's and the no-grad micro-batch
    (512 and 1,024 tokens here), with the AdamW moments until the first step, and the actor's plain head's
    logits, which the critic's value head does not have (without checkpointing, where they add to every layer's
    activations); for a short step batch, its tokens."""
    import json

    from conftest import ranks_cmd, run_torchrun
    from train.models.memory_plan import count_parameters, head_bytes, load_config, working_bytes

    proc = run_torchrun(ranks_cmd(1, "-c", PLANNED))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    config = load_config("stub/model")
    params, _ = count_parameters(config)
    plan = dict(seq=1024, lora_rank=0, checkpointing=False, master_weights=False)  # fp32 on CPU: no masters
    actor = working_bytes(config, fused_head=False, **plan)
    critic = working_bytes(config, fused_head=True, lm_head=False, **plan)
    assert out["cpu"] == [None, None] and out["before"][2] is None
    assert out["after"] == [actor, critic]
    # the same parameters but for the critic's value head in place of the LM head: the actor's head's bytes apart
    assert actor - working_bytes(config, fused_head=True, lm_head=False, counts=count_parameters(config), **plan) == (
        head_bytes(config, 1024, fused=False, trained=True))
    critic_params, _ = count_parameters(config, value_head=True)
    assert [b - a for b, a in zip(out["before"], out["after"])] == [8 * params, 8 * critic_params]
    assert out["short"] == working_bytes(config, fused_head=False, **{**plan, "seq": 300}) < actor
