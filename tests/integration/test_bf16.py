"""bf16 on CPU: `actor.dtype=bfloat16` (FSDP2 mixed precision: bf16 compute, fp32 master weights and
fp32 gradient reductions) and `rollout.dtype=bfloat16` (the engine's weights), on 1 and 2 ranks, so
the mixed-precision paths that GPUs run are exercised in CI. The sampler-trainer KL shows both
sides really ran in bf16: it is larger than the fp32 run's and still small."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import read_jsonl, run_trainer, slow

SMALL = ["trainer.total_steps=3", "data.prompts_per_rollout=4", "data.responses_per_prompt=4",
         "rollout.dynamic_filtering=false", "trainer.test_freq=null", "trainer.save_freq=null"]
BF16 = ["actor.dtype=bfloat16", "rollout.dtype=bfloat16"]


def sampler_kl(run) -> list[float]:
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "actor/sampler_kl" in r]
    assert len(rows) == 3, rows
    for r in rows:
        for key in ("actor/loss", "actor/grad_norm", "actor/sampler_kl"):
            assert math.isfinite(r[key]), (key, r)
    return [r["actor/sampler_kl"] for r in rows]


@pytest.fixture(scope="module")
def fp32_kl(tmp_path_factory) -> float:
    run = tmp_path_factory.mktemp("fp32")
    run_trainer([f"trainer.save_dir={run}", *SMALL])
    return max(sampler_kl(run))


@pytest.mark.parametrize("nproc", [slow(1), 2])
def test_bf16_actor_and_engine_train(tmp_path, fp32_kl, nproc):
    run_trainer([f"trainer.save_dir={tmp_path}", *SMALL, *BF16], nproc=nproc)
    kl = sampler_kl(tmp_path)
    print(f"sampler-trainer KL, bf16 on {nproc} rank(s): {kl} (fp32: {fp32_kl:.2e})")
    # bf16 rounding on both sides: clearly above the fp32 mismatch, far below a broken policy's
    assert min(kl) > 10 * fp32_kl and max(kl) < 0.05, (kl, fp32_kl)


@pytest.mark.slow
def test_bf16_lora_keeps_its_frozen_base_in_bf16(tmp_path, fp32_kl):
    """With LoRA, the frozen base is held in the compute dtype (no fp32 master copy; half the bytes)
    and the adapters in fp32: the merged export's projections come out bf16 (a full fine-tune's are
    its fp32 masters), the adapters fp32, and the run trains like any bf16 run."""
    from safetensors import safe_open

    run_trainer([f"trainer.save_dir={tmp_path}", *SMALL, *BF16, "actor.lora.rank=4", "actor.lr=1e-3"], nproc=2)
    kl = sampler_kl(tmp_path)
    assert min(kl) > 10 * fp32_kl and max(kl) < 0.05, (kl, fp32_kl)
    with safe_open(str(tmp_path / "latest" / "model.safetensors"), "pt") as f:
        merged = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    with safe_open(str(tmp_path / "latest" / "adapter" / "adapter_model.safetensors"), "pt") as f:
        adapter = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert merged.dtype == torch.bfloat16 and adapter.dtype == torch.float32
