"""MasterWeights (train/models/master_weights.py): bf16 weights for one process's model, fp32 masters for the
optimizer, cast once per step. The update against FSDP2's mixed precision over one rank, bit for bit, and a
checkpoint resumed on either path: tests/integration/test_master_weights_update.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config

from train.models.master_weights import MasterWeights, decide_master_weights, master_weights_refusal
from train.trainer.governor import Snapshot


def tiny(tied: bool = True) -> torch.nn.Module:
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class Ops(TorchDispatchMode):
    """The aten ops dispatched (what a GPU would launch: a foreach op is one multi-tensor kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_model_computes_in_bf16_and_the_masters_keep_its_fp32_storage() -> None:
    model = tiny()
    model.model.norm.weight.requires_grad_(False)  # a frozen weight: bf16, no master
    before = {name: (p.detach().clone(), p.data_ptr()) for name, p in model.named_parameters()}
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    mw = MasterWeights(model, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32 and torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
    masters = dict(mw.state_module.named_parameters(remove_duplicate=False))
    # the masters are the loaded fp32 tensors themselves (no copy), under the model's names (tied: both names)
    assert "lm_head.weight" in masters and masters["lm_head.weight"] is masters["model.embed_tokens.weight"]
    assert "model.norm.weight" not in masters
    for name, (value, ptr) in before.items():
        if name in masters:
            assert masters[name].data_ptr() == ptr and torch.equal(masters[name], value)
        assert torch.equal(model.get_parameter(name), value.to(torch.bfloat16)), name
    assert mw.state_module.state_dict().keys() == {k for k in model.state_dict() if k != "model.norm.weight"}


def test_gradient_sums_are_float32_sums_of_the_bf16_gradients_and_a_weight_without_one_gets_none() -> None:
    model = tiny()
    mw = MasterWeights(model, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    skipped = model.model.layers[1].mlp.up_proj.weight  # no gradient in the first backward
    expected = {}
    for backward in range(3):
        for p in mw.compute:
            if backward == 0 and p is skipped:
                continue
            grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            expected[id(p)] = expected.get(id(p), 0) + grad.double()
            p.grad = grad
        mw.collect()
        assert all(p.grad is None for p in mw.compute)  # the bf16 gradients are dropped once summed
    mw.attach()
    for p, m in zip(mw.compute, mw.masters):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, expected[id(p)].float())
    for m in mw.masters:  # the optimizer step's zero_grad (optim.clip_and_step), then what Trainable.optimizer_step calls
        m.grad = None
    mw.restart()
    unused = model.model.layers[0].self_attn.o_proj.weight
    for p in mw.compute:
        if p is not unused:
            p.grad = torch.ones_like(p)
    mw.collect()
    mw.attach()  # after a step, the sums start again: a weight no backward reached has no gradient for AdamW
    assert all((m.grad is None) == (p is unused) for p, m in zip(mw.compute, mw.masters))


def test_a_step_costs_one_cast_and_a_backward_two_multi_tensor_ops_whatever_the_tensor_count() -> None:
    model = tiny()
    mw = MasterWeights(model, torch.bfloat16)
    for p in mw.compute:
        p.grad = torch.ones_like(p)
    mw.collect()  # the first backward allocates the flat buffer of sums, once
    mw.discard()
    for p in mw.compute:
        p.grad = torch.ones_like(p)
    with Ops() as first:
        mw.collect()
    for p in mw.compute:
        p.grad = torch.ones_like(p)
    with Ops() as second:
        mw.collect()
    with torch.no_grad():
        for m in mw.masters:
            m.add_(0.5)
    with Ops() as cast:
        mw.publish()
    assert len(mw.compute) > 20
    assert first.names == ["aten._foreach_copy_.default"] and second.names == ["aten._foreach_add_.List"]
    assert cast.names == ["aten._foreach_copy_.default"]
    for p, m in zip(mw.compute, mw.masters):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_loading_a_state_dict_or_restoring_a_snapshot_casts_the_masters_into_the_model() -> None:
    model = tiny()
    mw = MasterWeights(model, torch.bfloat16)
    opt = torch.optim.AdamW(mw.state_module.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    saved = {k: v.clone() for k, v in mw.state_module.state_dict().items()}
    worker = {"actor": SimpleNamespace(state_parts=lambda: {"model": mw.state_module, "optimizer": opt,
                                                            "scheduler": sched})}
    snap = Snapshot(worker)
    with torch.no_grad():
        for m in mw.masters:
            m.mul_(3.0)
    mw.publish()
    assert not torch.equal(model.lm_head.weight, saved["lm_head.weight"].to(torch.bfloat16))
    snap.restore()  # the governor's rollback writes the masters in place
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name].to(torch.bfloat16)), name
    with torch.no_grad():
        for m in mw.masters:
            m.zero_()
    mw.publish()
    mw.state_module.load_state_dict(saved)  # a checkpoint's load
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name].to(torch.bfloat16)), name


def test_in_model_lends_the_masters_to_the_model_and_casts_what_was_written() -> None:
    model = tiny(tied=False)
    mw = MasterWeights(model, torch.bfloat16)
    with mw.in_model() as m:
        assert m is model and model.lm_head.weight.dtype == torch.float32
        assert model.lm_head.weight.data_ptr() == mw.state_module.get_parameter("lm_head.weight").data_ptr()
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, mw.state_module.get_parameter("lm_head.weight").to(torch.bfloat16))


def test_where_master_weights_apply_and_what_a_refusal_says() -> None:
    one, two = 1, 2  # the ranks the model is split over
    assert master_weights_refusal("actor", one, "bfloat16", False, False) is None
    assert "actor.dtype=float32" in master_weights_refusal("actor", one, "float32", False, False)
    assert "laid out over 2 ranks" in master_weights_refusal("actor", two, "bfloat16", False, False)
    assert "critic.offload_model" in master_weights_refusal("critic", one, "bfloat16", True, False)
    assert "vision-language" in master_weights_refusal("actor", one, "bfloat16", False, True)
    assert decide_master_weights(None, "actor", None, True) and not decide_master_weights(None, "actor", None, False)
    assert not decide_master_weights(False, "actor", None, True) and decide_master_weights(True, "actor", None, False)
    assert not decide_master_weights(None, "actor", "why", True)
    with pytest.raises(ValueError, match=r"actor.master_weights=true cannot apply: why; set actor.master_weights=null"):
        decide_master_weights(True, "actor", "why", True)
