"""actor.master_weights (train/models/master_weights.py): on one process in bf16 the model holds bf16 weights and
AdamW steps fp32 masters, cast into them once per step, instead of FSDP2's mixed precision over one rank. The same
update bit for bit, the same log-probs, and checkpoints that either path resumes exactly; a frozen model (the KL
reference) holds bf16 weights only, on any layout."""
from __future__ import annotations

import pytest
import torch

from conftest import flat, launch_check as launch, run_trainer, slow
from train.runtime.checkpoint import consolidate

FLAGS = ("--dtype", "bfloat16", "--max_tokens", "64", "--clip", "0.05")


@pytest.mark.parametrize("mode,flags", [("grads", []), ("grads", ["--lora", "8"]),
                                        slow("grads", ["--ac", "--grouped", "--share"]),
                                        slow("critic_grads", []), slow("critic_grads", ["--lora", "4"])])
def test_master_weights_give_fsdp2s_bf16_update_bit_for_bit(tmp_path, mode, flags):
    """Several packs per mini-batch (the sums go on over packs), clipping active: gradients, the clip norm and the
    updated weights equal FSDP2-over-one-rank's exactly (FSDP2 also casts the fp32 weights to bf16, accumulates
    the bf16 gradients in fp32 and steps fp32 AdamW; only where and how often differ)."""
    fsdp = launch(1, tmp_path / "fsdp.pt", mode, *FLAGS, *flags, "--masters", "false")
    masters = launch(1, tmp_path / "masters.pt", mode, *FLAGS, *flags, "--masters", "true")
    assert masters["masters"] and not fsdp["masters"]
    if mode == "grads":
        assert fsdp["packs"] == masters["packs"] >= 3 and masters["reduces"] == 0 and fsdp["reduces"] > 0
    assert masters["norm"] == fsdp["norm"] > 0.05
    assert masters["optimized"] == fsdp["optimized"]
    for part in ("grads", "weights"):
        assert masters[part].keys() == fsdp[part].keys()
        for name, value in fsdp[part].items():
            assert masters[part][name].dtype == value.dtype and torch.equal(masters[part][name], value), (part, name)


@pytest.mark.parametrize("nproc", [1, slow(2)])
def test_bf16_log_probs_agree_and_a_frozen_model_holds_bf16_weights(tmp_path, nproc):
    """A frozen model (the KL reference, a teacher) is held in bf16, half the bytes of the fp32 weights FSDP2 cast
    at each forward, a plain module on one process and FSDP2 shards over two; its log-probs, and an actor's with
    masters, equal the FSDP2 actor's bit for bit."""
    launch(nproc, tmp_path / "passes.pt", "bf16_passes")
    for rank in range(nproc):
        out = torch.load(tmp_path / f"passes.rank{rank}.pt")
        fsdp, frozen = out["fsdp"], out["frozen"]
        assert fsdp["fsdp"] and fsdp["dtypes"] == ["torch.float32"]
        assert frozen["dtypes"] == ["torch.bfloat16"] and frozen["bytes"] * 2 == fsdp["bytes"]
        assert frozen["fsdp"] == (nproc > 1)
        kinds = ["frozen", "masters"] if nproc == 1 else ["frozen"]
        if nproc == 1:
            assert not out["masters"]["fsdp"] and out["masters"]["masters"]
        for kind in kinds:
            assert out[kind]["logprobs"].keys() == fsdp["logprobs"].keys()
            for i, value in fsdp["logprobs"].items():
                assert torch.equal(out[kind]["logprobs"][i], value), (kind, i)


def test_a_master_weights_checkpoint_resumes_exactly_with_or_without_masters(tmp_path):
    """4 bf16 steps on one process (masters: actor.master_weights=null applies on CPU), checkpoints at 2 and 4;
    step 2 resumed with masters and with FSDP2's mixed precision: both step-4 checkpoints (weights, AdamW moments)
    and exports equal the straight run's bit for bit. The checkpoint holds the fp32 masters under the model's
    names, as FSDP2 writes its fp32 weights."""
    from safetensors.torch import load_file

    common = ["trainer.total_steps=4", "data.prompts_per_rollout=4", "data.responses_per_prompt=4",
              "rollout.dynamic_filtering=false", "trainer.test_freq=null", "actor.dtype=bfloat16",
              "rollout.dtype=bfloat16"]
    straight = tmp_path / "straight"
    proc = run_trainer([f"trainer.save_dir={straight}", "trainer.save_freq=2", *common])
    assert "actor: bf16 weights with fp32 masters" in proc.stdout + proc.stderr
    want = flat(consolidate(str(straight / "step4"))["actor"])
    assert any("exp_avg_sq" in k for k in want) and want["model/model.embed_tokens.weight/"].dtype == torch.float32
    exported = load_file(str(straight / "latest" / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.float32}  # the masters, not their bf16 casts
    for masters in ("true", "false"):
        run = tmp_path / masters
        run_trainer([f"trainer.save_dir={run}", "trainer.save_freq=4", f"trainer.load_ckpt_from={straight / 'step2'}",
                     f"actor.master_weights={masters}", *common])
        got = flat(consolidate(str(run / "step4"))["actor"])
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, (masters, key)
        again = load_file(str(run / "latest" / "model.safetensors"))
        assert again.keys() == exported.keys() and all(torch.equal(again[k], v) for k, v in exported.items())
