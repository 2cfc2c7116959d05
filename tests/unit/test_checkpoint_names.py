"""train/models/checkpoint_names.py: a Qwen3-MoE checkpoint in the Hub's per-expert layout read under the model's
fused names, whole, by block (the experts a rank holds), and as the empty block of a rank that holds none."""
from __future__ import annotations

import torch

from model_families import build
from train.models.checkpoint_names import ConvertedReader
from train.models.model_init import WeightReader


def test_fused_experts_read_whole_by_block_and_empty(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build("qwen3_moe", tmp_path / "moe"), dtype=torch.float32)
    reader = ConvertedReader(WeightReader(str(tmp_path / "moe")), model)
    state = model.state_dict()
    assert set(state) <= set(reader.keys())  # every tensor of the model has a name the reader answers to
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(reader.read(name), state[name])  # what from_pretrained fused, bit for bit
    block = (slice(1, 3), slice(8, 40), slice(None))
    assert torch.equal(reader.read(name, block), state[name][block])
    empty = reader.read(name, (slice(4, 4), slice(None), slice(None)))
    assert empty.shape == (0, *state[name].shape[1:]) and empty.dtype == state[name].dtype
