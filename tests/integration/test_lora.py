"""LoRA (issue 21): adapters on a frozen base. Only the adapters learn and hold optimizer state; 1 and
2 ranks (FSDP2, HSDP, Ulysses SP, activation checkpointing) give the same adapter gradients; the KL
reference is the base model (the actor with its adapters off); a push sends the adapters alone and
the engine then scores like the trainer; resume is bit-exact; the merged export and the peft adapter
folder load and generate what the trainer's model generates. The SGLang side of the push is in
tests/integration/test_sglang_adapter.py."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import STUB_MODEL, compose_config, read_jsonl, run_trainer, slow
from test_distributed import assert_same_update, launch
from test_trainer import assert_same
from train.models.lora import LoraSettings, LoraTargetError, apply_lora, is_adapter
from train.runtime.checkpoint import consolidate
from train.trainer.config import ConfigError, validate

LORA = ("--lora", "4")
LAYOUTS = {  # (processes, flags); on 2 ranks the groups' prompts are laid out once (actor.share_prompt)
    "dp2": (2, ["--ddp", "2", "--share"]),
    "fsdp2_checkpointed": (2, ["--ac", "--share"]),
    "sp2": (2, ["--sp", "2", "--share"]),
    "cp2": (2, ["--cp", "2", "--share"]),  # ring attention under the adapters
    "hsdp_ddp2_fsdp2": (4, ["--ddp", "2"]),  # 4 dp groups: too few samples each for a shared prompt
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    cache: dict = {}

    def get(mode: str) -> dict:
        if mode not in cache:
            out = tmp_path_factory.mktemp("lora") / "one.pt"
            cache[mode] = launch(1, out, mode, "--max_tokens", "200", "--clip", "0.05", "--grouped", *LORA)
        return cache[mode]
    return get


def test_only_the_adapters_learn_and_hold_optimizer_state(one_process):
    one = one_process("grads")
    assert one["grads"] and all(is_adapter(name) for name in one["grads"])
    assert sorted(one["optimized"]) == sorted(one["grads"])  # Adam moments for adapters only
    assert one["frozen_grads"] == []
    base = load_file(str(STUB_MODEL / "model.safetensors"))
    for name, weight in one["weights"].items():
        if not is_adapter(name):  # after a real optimizer step, the base is the checkpoint's, bit for bit
            assert torch.equal(weight, base[name.replace(".base_layer.", ".")]), name


@pytest.mark.parametrize("layout", [layout if layout == "dp2" else slow(layout) for layout in LAYOUTS])
def test_lora_layouts_give_the_one_process_adapter_update(tmp_path, one_process, layout):
    nproc, flags = LAYOUTS[layout]
    other = launch(nproc, tmp_path / "x.pt", "grads", "--max_tokens", "64", "--clip", "0.05", "--grouped", *LORA,
                   *flags)
    # cp2: the smallest adapter gradient (layer 2's q_proj lora_A, 1/300 of the largest) is 5e-6 (cp2) and 8e-6
    # (one process) of its scale from the same run in float64, so the two float32 runs differ by up to 1.4e-5
    assert_same_update(one_process("grads"), other, grad_rtol=2e-5 if layout == "cp2" else 1e-5)
    assert sorted(other["optimized"]) == sorted(other["grads"])


@pytest.mark.slow
def test_critic_lora_trains_adapters_and_the_whole_value_head(tmp_path, one_process):
    one = one_process("critic_grads")
    assert {n for n in one["grads"] if not is_adapter(n)} == {"value_head.weight", "value_head.bias"}
    other = launch(2, tmp_path / "x.pt", "critic_grads", "--max_tokens", "64", "--clip", "0.05", "--grouped",
                   "--share", *LORA)
    assert_same_update(one, other)


def test_the_reference_is_the_base_and_a_push_sends_adapters_only(tmp_path):
    out = launch(2, tmp_path / "ref.pt", "lora_reference")
    assert out["ref_diff"] < 1e-6  # adapters off == a separately built base model
    assert out["policy_diff"] > 1e-3  # the adapted policy is another model
    assert out["kl"] > 0
    adapters = sorted(n for n in out["engine_names"] if is_adapter(n))
    assert len(adapters) == 4 * 7 * 2  # 4 layers x 7 projections x (A, B)
    assert sorted(out["pushed"]) == adapters  # not one base tensor travels
    assert out["probe_diff"] < 5e-5  # the engine samples from what the trainer holds (max |diff|, float rounding)


def greedy(model, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(n):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
            out.append(ids[0, len(p):].tolist())
    return out


def test_a_lora_run_resumes_exactly_and_both_exports_generate_the_trainers_tokens(tmp_path):
    """2 ranks, KL against the base (no reference model), the sync probe every step: 4 steps straight
    against 2 + resume + 2; checkpoints hold adapters alone; latest/ (merged) and latest/adapter (peft)
    generate exactly what the base with the trained adapters generates."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from train.engines.hf import HFEngine

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # the fused log-prob head too: the probe then checks it against the engine
    common = ["trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=null", "actor.lora.rank=8",
              "actor.lora.alpha=16", "actor.lr=2e-3", "actor.kl.coef=0.05", "trainer.sync_probe_every=1",
              "data.prompts_per_rollout=8", "data.responses_per_prompt=4", "actor.use_liger_kernel=true"]
    first = run_trainer([f"trainer.save_dir={straight}", *common], nproc=2)
    assert "actor: LoRA rank 8 (alpha 16)" in first.stdout + first.stderr
    run_trainer([f"trainer.save_dir={resumed}", f"trainer.load_ckpt_from={straight / 'step2'}", *common], nproc=2)
    final = consolidate(str(straight / "step4"))
    assert_same(final, consolidate(str(resumed / "step4")))
    assert final["actor"]["model"] and all(is_adapter(k) for k in final["actor"]["model"])

    metrics = [m for m in read_jsonl(straight / "metrics.jsonl") if m["step"] > 0]
    assert all(m["engine/probe_abs_diff"] < 1e-5 for m in metrics)  # mean |diff| of the probe's log-probs
    assert all(m["actor/kl"] >= 0 for m in metrics) and any(m["actor/kl"] > 0 for m in metrics)

    # The trainer's model: the base with the final checkpoint's adapters.
    trained = AutoModelForCausalLM.from_pretrained(STUB_MODEL, dtype=torch.float32)
    apply_lora(trained, LoraSettings(8, 16.0))
    missing = trained.load_state_dict(final["actor"]["model"], strict=False)
    assert not missing.unexpected_keys
    merged = AutoModelForCausalLM.from_pretrained(straight / "latest", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(STUB_MODEL, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, straight / "latest" / "adapter")
    config = json.loads((straight / "latest" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == str(STUB_MODEL)
    prompts = [[1, 50, 60, 70], [1, 9, 8, 7, 6, 5], [1, 300, 301]]
    want = greedy(trained, prompts)
    assert greedy(merged, prompts) == want and greedy(peft, prompts) == want
    ids = torch.tensor([prompts[1] + want[1]])
    untouched = AutoModelForCausalLM.from_pretrained(STUB_MODEL, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=1e-4)
        moved = float((merged(input_ids=ids).logits - untouched(input_ids=ids).logits).abs().max())
    assert moved > 1e-3  # the adapters learned something, so the comparisons above prove something
    served = HFEngine.from_pretrained(str(straight / "latest" / "adapter"))  # what train.serve loads
    assert greedy(served.model, prompts) == want


@pytest.mark.parametrize("override, key", [
    (["actor.lora.rank=4", "actor.tp_size=2"], r"actor\.lora\.rank': LoRA with tensor parallelism"),
    (["actor.lora.rank=-1"], r"actor\.lora\.rank': expected 0 \(off\) or a positive integer"),
    (["actor.lora.rank=4", "actor.lora.alpha=0"], r"actor\.lora\.alpha'"),
    (["actor.lora.rank=4", "actor.lora.dropout=1.0"], r"actor\.lora\.dropout': expected a number in \[0, 1\)"),
    (["actor.lora.rank=4", "actor.lora.target_modules=[]"], r"actor\.lora\.target_modules': expected a non-empty"),
    (["adv.estimator=gae", "critic.lora.rank=4", "critic.tp_size=2"], r"critic\.lora\.rank': LoRA with tensor"),
    (["actor.lora.rank=4", "rollout.model_name=tests"], r"rollout\.model_name': with actor\.lora\.rank > 0"),
])
def test_bad_lora_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key):
        validate(compose_config(override), world_size=2)


def test_unknown_or_unsupported_targets_are_refused_naming_the_key():
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(STUB_MODEL))
    with pytest.raises(LoraTargetError, match=r"actor\.lora\.target_modules': \['qkv'\] name no linear layer"):
        apply_lora(model, LoraSettings(4, target_modules=("q_proj", "qkv")))
    with pytest.raises(LoraTargetError, match="output head"):
        apply_lora(model, LoraSettings(4, target_modules=("lm_head",)))
