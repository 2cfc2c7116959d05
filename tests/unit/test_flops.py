"""The MFU's FLOP count (benchmarks/vs_trl.py `active_body_params`, used by the GPU suite) against torch's own
FLOP counter on a real forward of each kind of model: dense, and a mixture of experts, where only the router
and the experts each token is sent to count."""
from __future__ import annotations

import sys

import pytest
import torch

from conftest import ROOT, slow
from model_families import build

sys.path.insert(0, str(ROOT / "benchmarks"))
from vs_trl import active_body_params  # noqa: E402


@pytest.mark.parametrize("family", [slow("qwen3"), "qwen3_moe", "mixtral"])
def test_active_parameters_are_what_a_forward_multiplies(tmp_path, family):
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    # eager attention and experts: plain matmuls the counter sees (a grouped-matmul kernel it does not count)
    extra = {"experts_implementation": "eager"} if family != "qwen3" else {}
    model = AutoModelForCausalLM.from_pretrained(build(family, tmp_path / family), dtype=torch.float32,
                                                 attn_implementation="eager", **extra)
    c = model.config
    T = 24
    ids = torch.randint(3, 500, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    # transformers before 5.24 builds the RoPE angles with a matmul the counter sees; not a parameter's FLOPs
    rotary = sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name.endswith("rotary_emb"))
    counted = counter.get_total_flops() - rotary
    heads_dim = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    scores = c.num_hidden_layers * 2 * (2 * T * T * heads_dim)  # q k^T and p v, full (eager) matrices
    head = 2 * T * c.hidden_size * c.vocab_size
    assert counted - scores - head == 2 * T * active_body_params(c)
    if family != "qwen3":  # far fewer than all the experts' parameters
        total = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and "norm" not in n)
        assert active_body_params(c) < 0.75 * total
