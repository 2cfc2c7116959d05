"""Router replay through the trainer's own path (train/models/router_replay.py): the hf engine records the
experts, dispatch carries them across ranks, packing lays them out, the actor's routers take them."""
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ROOT, run_torchrun, slow
from model_families import build
from train.models.router_replay import moe_routers


def tied_moe(folder) -> str:
    """A tiny Qwen3-MoE whose experts 0 and 1 have the same gate row in every layer: tokens for which they
    are in contention are routed by how each side breaks a near-tie."""
    build("qwen3_moe", folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight[1] = router.weight[0]
    model.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("layout", [pytest.param(["--share"], id="fsdp2-shared-prompts"),
                                    slow(["--sp", "2", "--ac"], id="sp2-checkpointing")])
def test_replayed_routing_gives_the_samplers_logprobs_where_a_flipped_top_k_does_not(tmp_path, layout):
    model = tied_moe(tmp_path / "moe")
    out = tmp_path / "replay.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           str(ROOT / "tests" / "dist_checks.py"), "router_replay", "--model", model, *layout, "--out", str(out)]
    proc = run_torchrun(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = torch.load(out)
    # the engine's gate moved by 1e-6: routed by the trainer itself, some tokens go to other experts ...
    assert result["own_tokens_off"] > 0 and result["own"] > 1e-3, result
    # ... and under the sampler's routing every token's log-prob is the sampler's (fp32)
    assert result["replayed_tokens_off"] == 0 and result["replayed"] < 1e-5, result


def test_router_settings_on_a_model_without_experts_or_an_engine_without_routing_are_refused(tmp_path):
    from conftest import compose_config
    from train.trainer.config import ConfigError, validate

    dense = ROOT / "stub" / "model"
    for key, value, off in (("router_replay", "response", "null"), ("router_aux_loss_coef", "0.01", "0")):
        with pytest.raises(ConfigError, match=rf"'actor.{key}': .*is not a mixture of experts.*actor.{key}={off}"):
            validate(compose_config([f"actor.model_name={dense}", f"actor.{key}={value}"]))
    moe = build("qwen3_moe", tmp_path / "moe")
    with pytest.raises(ConfigError, match=r"'actor.router_replay': needs rollout.engine=hf"):
        validate(compose_config([f"actor.model_name={moe}", "actor.router_replay=all", "rollout.engine=sglang"]))
    with pytest.raises(ConfigError, match=r"actor.router_replay.*expected one of"):
        validate(compose_config([f"actor.model_name={moe}", "actor.router_replay=sometimes"]))
    validate(compose_config([f"actor.model_name={moe}", "actor.router_replay=all", "actor.router_aux_loss_coef=0.01"]))


@pytest.mark.parametrize("resume", [False, slow(True, id="resumed")])
def test_a_checkpointed_pending_rollout_keeps_its_routing_and_resumes_exactly(tmp_path, resume):
    """rollout.max_staleness=1: the step-2 checkpoint holds step 3's finished rollout, each sample with the
    experts the sampler chose; resumed, step 3 trains on it as the straight run did (the same loss). (That
    a pending rollout's samples resume bit for bit is tests/integration/test_async.py's in the default suite.)"""
    from conftest import read_jsonl, run_trainer

    model = build("qwen3_moe", tmp_path / "moe")
    env = tmp_path / "parity.py"
    env.write_text('def reward_fn(messages, answer):\n    return float(sum(map(ord, messages[-1]["content"])) % 2)\n')
    common = [f"actor.model_name={model}", f"rollout.env_path={env}", "rollout.max_staleness=1",
              "data.prompts_per_rollout=2", "data.responses_per_prompt=4", "rollout.dynamic_filtering=false",
              "trainer.test_freq=null", "actor.router_replay=all", "trainer.total_steps=3"]
    straight = tmp_path / "straight"
    run_trainer([f"trainer.save_dir={straight}", "trainer.save_freq=2", *common])
    rank_state = torch.load(straight / "step2" / "rank0.pt", weights_only=False)
    [pending] = rank_state["pending_rollout"]
    assert pending.step == 3 and pending.samples
    for sample in pending.samples:  # prompt and response: every position but the last ran in the engine
        assert sample.routing.dtype == torch.uint8 and sample.routing.shape == (len(sample.ids) - 1, 2, 2)
    if not resume:
        return
    resumed = tmp_path / "resumed"
    run_trainer([f"trainer.save_dir={resumed}", f"trainer.load_ckpt_from={straight / 'step2'}", *common])
    [again] = read_jsonl(resumed / "metrics.jsonl")
    before = {m["step"]: m for m in read_jsonl(straight / "metrics.jsonl")}[3]
    assert again["step"] == 3 and again["actor/loss"] == before["actor/loss"]
    assert again["actor/sampler_kl"] < 1e-4


@pytest.mark.slow
def test_the_upcycled_moe_stub_learns_the_stub_task_with_router_replay(tmp_path):
    """stub/build_moe_stub.py's Mixtral on the README's demo task, 2 ranks, 100 steps: the greedy test reward
    rises while the sampler's and the trainer's log-probs agree (fp32, replayed routing)."""
    from conftest import load_file, read_jsonl, run_trainer

    model = load_file(ROOT / "stub" / "build_moe_stub.py").build(tmp_path / "moe_stub")
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", f"actor.model_name={model}", "actor.router_replay=response",
                 "actor.router_aux_loss_coef=0.001", "trainer.total_steps=100", "trainer.save_freq=null"],
                nproc=2, timeout=900)
    rows = read_jsonl(run / "metrics.jsonl")
    tests = {r["step"]: r["rewards/test"] for r in rows if "rewards/test" in r}
    assert tests[100] > tests[0] + 0.05, tests
    assert max(r["actor/sampler_kl"] for r in rows if "actor/sampler_kl" in r) < 1e-4
