"""train/models/memory_plan.py: parameter counts are the model's own, and the estimate reproduces the
peaks measured on one GPU (benchmarks/gpu_suite.py --only bigmodel)."""
import pytest
import torch

from conftest import ROOT
from train.models.memory_plan import GIB, CARDS, PRESETS, count_parameters, load_config, main, plan, preset_config, table

# One NVIDIA H100 80GB HBM3, 2026-11-27 (benchmarks/README.md): the engine with its own copy of the base
# (rollout.share_actor_base came after) and foreach AdamW (fused came after). GiB, torch.cuda.max_memory_allocated.
MEASURED = [
    dict(model="llama3.1-8b", lora_rank=32, update=28.3, rollout=33.4),
    dict(model="qwen3-4b", lora_rank=0, update=75.3, rollout=54.4),
]


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_parameter_counts_are_those_of_the_built_model(lora_rank):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from train.models.lora import LoraSettings, apply_lora, is_adapter

    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    if lora_rank:
        apply_lora(model, LoraSettings(rank=lora_rank, alpha=8.0))
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    assert count_parameters(config, lora_rank) == (sum(p.numel() for p in model.parameters()) - adapters, adapters)
    assert (adapters > 0) == bool(lora_rank)


@pytest.mark.parametrize("run", MEASURED, ids=lambda r: f"{r['model']}-r{r['lora_rank']}")
def test_the_estimate_reproduces_the_measured_peaks(run):
    p = plan(preset_config(run["model"]), seq=16384, lora_rank=run["lora_rank"], share_base=False, foreach=True)
    for phase, peak in (("update", p.update_peak), ("rollout", p.rollout_peak)):
        assert abs(peak / GIB - run[phase]) / run[phase] < 0.12, (phase, peak / GIB, run[phase])


def test_sharing_the_base_and_fused_adamw_take_what_they_should():
    config = preset_config("llama3.1-8b")
    own, shared = (plan(config, seq=16384, lora_rank=32, share_base=s) for s in (False, True))
    assert own.rollout_peak - shared.rollout_peak == 2 * own.params  # the engine's bf16 base
    full_foreach, full_fused = (plan(preset_config("qwen3-4b"), seq=16384, foreach=f) for f in (True, False))
    # foreach peaks in its step (4 bytes per parameter on top), fused in the backward pass
    assert full_foreach.update_peak - full_fused.update_peak == 4 * full_fused.params - full_fused.activations - full_fused.unshard
    assert not full_foreach.fits(CARDS["80 GB (H100)"]) and full_fused.fits(CARDS["80 GB (H100)"])


def test_the_command_prints_a_plan_and_names_what_it_does_not_know(capsys):
    assert main(["--model", "qwen2.5-0.5b", "--lora-rank", "8", "--seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-0.5b" in out and "LoRA rank 8" in out and "fits" in out
    with pytest.raises(ValueError, match="neither a preset"):
        load_config("no-such-model")
    assert set(PRESETS) >= {"llama3.1-8b", "qwen3-4b"}
    assert torch.get_default_device().type == "cpu"  # nothing was built on a real device


def test_docs_gpu_md_holds_the_current_table():
    """docs/gpu.md's "What fits on one GPU" table is this module's output (regenerate it with
    `.venv/bin/python -m train.models.memory_plan --table`)."""
    assert table() in (ROOT / "docs" / "gpu.md").read_text()
