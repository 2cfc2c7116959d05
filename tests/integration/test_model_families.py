"""The conformance matrix (tests/model_families.py, docs/models.md): every family x feature cell run for real.
A ✓ cell must work: loaded on the meta device shard by shard equal to `from_pretrained` (bit for bit; logits
too, to 1e-4 under TP), and trained 2 steps on 2 CPU ranks with the sampler and the trainer agreeing in fp32.
A ✗ cell must be refused at start-up with its reason, before anything loads."""
from __future__ import annotations

import asyncio
import math
import textwrap

import pytest
import torch

from conftest import ROOT, compose_config, ranks_cmd, read_jsonl, run_torchrun, run_trainer, slow
from model_families import FAMILIES, MATRIX, MIXTURES, build, markdown
from train.trainer.config import ConfigError, validate

# The cells the default suite runs; the others are in the slow set. A training cell loads its family under its
# layout and checks the trainer's log-probs against the engine's from_pretrained copy, so it also catches a
# wrong load: Gemma 3 under TP (its extra norms, its buffers), GPT-OSS under SP (its sinks in packed rows),
# Qwen3-MoE under EP (the fused-expert reader, experts split over ranks; its block reads are also
# tests/unit/test_checkpoint_names.py's).
DEFAULT = {("qwen3_moe", "train_ep2"), ("gemma3", "train_tp2"), ("gpt_oss", "train_sp2"),
           *((family, feature) for family in FAMILIES for feature in ("decode", "lora"))}  # (in-process, < 1 s each)

LAYOUTS = {"load": (1, []), "fsdp2": (2, []), "tp2": (2, ["--tp", "2"]),
           "train_fsdp2": (2, []), "train_tp2": (2, ["actor.tp_size=2"]),
           "train_sp2": (2, ["actor.sp_size=2", "actor.use_liger_kernel=true"]), "train_ep2": (2, ["actor.ep_size=2"])}

# Rewards that differ within a group whatever a random model says (their parity), so advantages are not 0
PARITY_ENV = """
def reward_fn(messages, answer):
    return float(sum(map(ord, messages[-1]["content"])) % 2)
"""


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    folders: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in folders:
            folders[family] = build(family, tmp_path_factory.mktemp(family.replace(".", "_")))
        return folders[family]

    return get


def cells(features: tuple[str, ...], works: bool):
    out = []
    for family, row in MATRIX.items():
        for feature in features:
            if (row[feature] is None) == works:
                case = (family, feature)
                out.append(pytest.param(*case, id=f"{family}-{feature}") if case in DEFAULT or not works
                           else slow(*case, id=f"{family}-{feature}"))
    return out


@pytest.mark.parametrize("family,feature", cells(("load", "fsdp2", "tp2"), works=True))
def test_a_family_loads_shard_by_shard_like_from_pretrained(tmp_path, family_model, family, feature):
    nproc, flags = LAYOUTS[feature]
    out = tmp_path / "load.pt"
    cmd = ranks_cmd(nproc, str(ROOT / "tests" / "dist_checks.py"), "load", "--model", family_model(family), *flags,
                    "--out", str(out))
    proc = run_torchrun(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = torch.load(out)
    for role in ("actor", "critic"):
        assert result[role]["weights"] and all(result[role]["weights"].values()), (role, result[role]["weights"])
        assert result[role]["extra_keys"] == [] and all(result[role]["buffers"].values())
    assert result["tied"]
    if feature == "tp2":  # row-parallel matmuls add in another order
        assert result["logits_err"] < 1e-4 and result["values_err"] < 1e-4
    else:
        assert result["logits_equal"] and result["values_err"] == 0.0


@pytest.mark.parametrize("family,feature", cells(("train_fsdp2", "train_tp2", "train_sp2", "train_ep2"), works=True))
def test_a_family_trains_two_steps_on_two_ranks(tmp_path, family_model, family, feature):
    env = tmp_path / "parity.py"
    env.write_text(textwrap.dedent(PARITY_ENV))
    run = tmp_path / "run"
    nproc, flags = LAYOUTS[feature]
    experts = family in MIXTURES  # with router replay, the load-balancing loss and activation checkpointing
    moe = ["actor.router_replay=response", "actor.router_aux_loss_coef=0.01",
           "actor.gradient_checkpointing=true"] if experts else []
    folder = family_model(family)
    run_trainer([f"trainer.save_dir={run}", f"actor.model_name={folder}", f"rollout.env_path={env}",
                 "trainer.total_steps=2", "data.prompts_per_rollout=4", "data.responses_per_prompt=4",
                 "rollout.dynamic_filtering=false", "trainer.test_freq=null", "trainer.save_freq=2", *flags, *moe],
                nproc=nproc)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert len(metrics) == 2
    for m in metrics:
        assert math.isfinite(m["actor/loss"]) and m["actor/grad_norm"] > 0
        if experts:  # top-2 of 4 experts: a perfectly balanced router scores 2
            assert 1.9 < m["actor/router_aux_loss"] < 4.0, m
        # the engine's log-probs and the trainer's agree in fp32: the same model, the same routing
        assert m["actor/sampler_kl"] < 1e-4 and m["actor/sampler_abs_diff"] < 1e-4, m
    assert metrics[-1]["actor/weight_change"] > 0
    if feature in ("train_fsdp2", "train_ep2"):
        assert_export_is_the_trained_model_in_the_hub_layout(run / "latest", run / "step2", folder)


def file_keys(folder) -> set[str]:
    from safetensors import safe_open

    keys = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys |= set(f.keys())
    return keys


def assert_export_is_the_trained_model_in_the_hub_layout(latest, step, original) -> None:
    """`latest/` holds the tensors under the names the family's own files use (per-expert names for mixtures
    of experts, as save_pretrained writes them), and from_pretrained gives the checkpoint's weights bit for bit."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from train.runtime.checkpoint import consolidate

    tied = {"lm_head.weight"}  # a tied head is one tensor in the files
    assert file_keys(latest) - tied == file_keys(Path(original)) - tied
    trained = consolidate(str(step))["actor"]["model"]
    exported = AutoModelForCausalLM.from_pretrained(latest, dtype=torch.float32).state_dict()
    assert set(trained) <= set(exported)
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor.float()), name


@pytest.mark.parametrize("family,feature", cells(("tp2", "train_tp2"), works=False))
def test_a_family_without_a_tensor_parallel_plan_is_refused_at_start(family_model, family, feature):
    why = {"phi3": "fused qkv_proj", "olmo2": "q/k norms span all heads"}.get(family, "mixture of experts")
    with pytest.raises(ConfigError, match=rf"actor.tp_size=2: tensor parallelism supports .*{why}.*; set "
                                          r"actor.tp_size=1"):
        validate(compose_config([f"actor.model_name={family_model(family)}", "actor.tp_size=2"]), world_size=2)


@pytest.mark.parametrize("family,feature", cells(("train_ep2",), works=False))
def test_expert_parallelism_on_a_dense_family_is_refused_at_start(family_model, family, feature):
    with pytest.raises(ConfigError, match=r"actor.ep_size=2: \w+ is not a mixture of experts; set actor.ep_size=1"):
        validate(compose_config([f"actor.model_name={family_model(family)}", "actor.ep_size=2"]), world_size=2)


@pytest.mark.parametrize("family,feature", cells(("packing",), works=True))
def test_a_family_packs_rows_with_shared_prompts_like_each_sequence_alone(tmp_path, family_model, family, feature):
    """The actor's packed passes (several packs, each group's prompt laid out once, FSDP2 on 1 process)
    against the plain model on each sequence alone: log-probs on action tokens, the policy loss's gradient."""
    out = tmp_path / "packing.pt"
    cmd = ranks_cmd(1, str(ROOT / "tests" / "dist_checks.py"), "packing", "--model", family_model(family), "--grouped",
                    "--share", "--out", str(out))
    proc = run_torchrun(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = torch.load(out)
    assert result["packs"] >= 2 and result["logp_err"] < 1e-5, result["logp_err"]
    for name, (got, ref) in result["grads"].items():  # (an expert no token went to has no gradient)
        scale = float(ref.abs().max())
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * scale if scale else 0.0, msg=name)


def seeded_decode(engine, prompts: list[list[int]]) -> list:
    from train.engines.base import SamplingParams

    async def run():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=12, seed=i))
                                      for i, p in enumerate(prompts)))
    return asyncio.run(run())


@pytest.mark.parametrize("family,feature", cells(("decode",), works=True) + cells(("decode",), works=False))
def test_a_family_decodes_the_same_over_the_static_cache(family_model, family, feature):
    """The hf engine's static-cache path (on CPU without graphs) against its dynamic path: the same seeded
    samples, token for token, and their log-probs; a family the static path cannot hold takes the dynamic one."""
    from transformers import AutoModelForCausalLM

    from train.engines.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(family_model(family), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # sharp logits: no near-ties between the two paths
    static = HFEngine(model, eos_token_ids=[], static_cache=True, seed=0)
    if MATRIX[family]["decode"] is not None:
        assert not static.static_cache  # the engine chose the dynamic cache itself
        return
    dynamic = HFEngine(model, eos_token_ids=[], static_cache=False, seed=0)
    prompts = [[3, 4, 5, 6, 7, 8]] * 3 + [[9, 10], [11, 12, 13, 14]]
    a, b = seeded_decode(static, prompts), seeded_decode(dynamic, prompts)
    assert static.stats["static_batches"] > 0 and dynamic.stats["static_batches"] == 0
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


@pytest.mark.parametrize("family,feature", cells(("lora",), works=True) + cells(("lora",), works=False))
def test_lora_adapts_a_familys_attention_and_mlp_projections(family_model, family, feature):
    """LoRA as the actor builds it (train/models/lora.py): adapters on every targeted projection, the model
    unchanged until they train, gradients on the adapters only. A mixture of experts has no linear expert
    layers: the MLP targets are refused naming them, and the attention projections still take adapters."""
    from transformers import AutoModelForCausalLM

    from model_families import LORA_TARGETS
    from train.models.lora import DEFAULT_TARGETS, LoraSettings, LoraTargetError, apply_lora, is_adapter, lora_modules

    model = AutoModelForCausalLM.from_pretrained(family_model(family), dtype=torch.float32)
    targets = LORA_TARGETS.get(family, DEFAULT_TARGETS)
    if MATRIX[family]["lora"] is not None:
        with pytest.raises(LoraTargetError, match=r"\['gate_proj', 'up_proj', 'down_proj'\] name no linear layer"):
            apply_lora(model, LoraSettings(rank=4, target_modules=targets))
        targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    ids = torch.randint(3, 500, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
    apply_lora(model, LoraSettings(rank=4, target_modules=targets))
    adapted = {name.rsplit(".", 1)[-1] for name, _ in lora_modules(model)}
    assert adapted == set(targets)
    assert len(list(lora_modules(model))) == len(targets) * model.config.num_hidden_layers
    logits = model(ids).logits
    assert torch.equal(logits, before)  # B starts at zero
    logits.square().mean().backward()
    trained = {name for name, p in model.named_parameters() if p.grad is not None}
    assert trained and all(is_adapter(name) for name in trained)


def test_a_quantized_checkpoint_is_refused_naming_what_to_do(tmp_path):
    """GPT-OSS's Hub checkpoints hold MXFP4 experts (`quantization_config` in config.json): refused at start."""
    import json
    import shutil

    folder = tmp_path / "gpt_oss_mxfp4"
    shutil.copytree(build("gpt_oss", tmp_path / "gpt_oss"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"'actor.model_name': .* is a quantized checkpoint \(mxfp4\).*Mxfp4Config"
                                          r"\(dequantize=True\)"):
        validate(compose_config([f"actor.model_name={folder}"]))


def test_the_matrix_in_the_docs_is_the_generated_one():
    """docs/models.md holds `python tests/model_families.py --markdown` verbatim, between its markers."""
    text = (ROOT / "docs" / "models.md").read_text()
    begin, end = "<!-- matrix: generated by tests/model_families.py -->\n", "\n<!-- end of matrix -->"
    assert begin in text and end in text
    assert text.split(begin, 1)[1].split(end, 1)[0] == markdown()
    assert set(FAMILIES) == set(MATRIX)
