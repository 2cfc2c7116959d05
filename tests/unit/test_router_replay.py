"""Router replay and the load-balancing loss (train/models/router_replay.py), on tiny random mixtures of
experts built in code: the replay rules against each router class's own forward, the engine's record
against a full forward, the per-sample routes, the balance loss against transformers' and a float64
reference."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from train.engines.base import SamplingParams
from train.engines.hf import HFEngine
from train.models.router_replay import (REPLAY_RULES, RouterBalance, RouterReplay, RoutingSpec, moe_routers,
                                        replay_refusal, routing_spec, sample_routes)
from train.workers.rollout import Sample, record_routing

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
ROUTERS = {  # router class -> (model_type, config overrides)
    "Qwen3MoeTopKRouter": ("qwen3_moe", dict(head_dim=8, moe_intermediate_size=16, num_experts=8,
                                             num_experts_per_tok=2, norm_topk_prob=True)),
    "Qwen2MoeTopKRouter": ("qwen2_moe", dict(moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                             num_experts=8, num_experts_per_tok=2)),
    "OlmoeTopKRouter": ("olmoe", dict(num_experts=8, num_experts_per_tok=2, eos_token_id=1)),
    "MixtralTopKRouter": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "GptOssTopKRouter": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8)),
}


def moe(router_class: str = "Qwen3MoeTopKRouter", seed: int = 0) -> torch.nn.Module:
    model_type, overrides = ROUTERS[router_class]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**COMMON, **overrides}))
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.normal_(0, 0.5)  # the zero init routes every token alike
    return model.eval()


def test_every_router_class_with_a_rule_is_tested_here():
    assert set(REPLAY_RULES) == set(ROUTERS)


@pytest.mark.parametrize("router_class", sorted(ROUTERS))
def test_replaying_a_routers_own_choices_gives_its_outputs_bit_for_bit(router_class):
    router = moe_routers(moe(router_class))[0]
    hidden = torch.randn(37, COMMON["hidden_size"])
    own = type(router).forward(router, hidden)
    rule = REPLAY_RULES[router_class]
    for recorded in (own[2], torch.full_like(own[2], 255)):  # its own experts; nothing recorded
        replayed = rule(router, hidden, recorded)
        for a, b in zip(own, replayed):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("router_class", ["Qwen3MoeTopKRouter", "MixtralTopKRouter", "GptOssTopKRouter"])
def test_a_replayed_router_takes_the_recorded_experts_with_its_own_probabilities(router_class):
    model = moe(router_class)
    router = moe_routers(model)[0]
    replay = RouterReplay(model)
    hidden = torch.randn(5, COMMON["hidden_size"], dtype=torch.float64)
    recorded = torch.tensor([[7, 0], [1, 2], [3, 6], [5, 4], [255, 255]], dtype=torch.uint8)
    routes = torch.stack([recorded, recorded], dim=1)  # [positions, layers, top_k]
    replay.set(routes)
    router.double()
    logits, scores, chosen = router(hidden)
    own = type(router).forward(router, hidden)[2]
    assert chosen[:4].tolist() == recorded[:4].long().tolist() and chosen[4].tolist() == own[4].tolist()
    # float64 reference of the scores, written from the routing rule's definition
    w = router.weight.detach()
    b = router.bias.detach() if router_class == "GptOssTopKRouter" else torch.zeros(w.shape[0], dtype=torch.float64)
    for t in range(5):
        z = hidden[t] @ w.T + b
        picked = chosen[t].tolist()
        if router_class == "GptOssTopKRouter":
            expected = torch.softmax(z[picked], 0)
        else:
            p = torch.softmax(z, 0)[picked]
            expected = p / p.sum()
        assert torch.allclose(scores[t].double(), expected, atol=1e-12)
    scores.sum().backward() if router_class == "GptOssTopKRouter" else (scores * torch.arange(2.0)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0  # the gate trains under replay
    with pytest.raises(RuntimeError, match="routes for 5 positions, the forward has 3"):
        router(hidden[:3])
    replay.clear()
    assert torch.equal(router(hidden)[2], own)


def test_replay_refuses_a_dense_model_and_a_router_without_a_rule():
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **COMMON, head_dim=8))
    assert "not a mixture of experts" in replay_refusal(dense) and routing_spec(dense) is None
    with pytest.raises(ValueError, match="actor.router_replay: .*not a mixture of experts"):
        RouterReplay(dense)
    model = moe()
    for router in moe_routers(model):
        router.__class__ = type("FancyTopKRouter", (type(router),), {})
    assert "no replay rule for the router FancyTopKRouter" in replay_refusal(model)


def test_a_routing_record_is_one_byte_per_choice_up_to_255_experts():
    assert RoutingSpec(48, 8, 128).bytes_per_token == 384  # Qwen3-30B-A3B: 48 layers x top-8
    assert RoutingSpec(48, 8, 128).none == 255
    wide = RoutingSpec(58, 8, 256)  # DeepSeek-V3: 256 routed experts, 255 is an expert
    assert wide.dtype == torch.int16 and wide.none >= 256 and wide.bytes_per_token == 58 * 8 * 2


def generate(engine: HFEngine, prompts: list[list[int]], new: int) -> list:
    async def run():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=new, seed=i))
                                      for i, p in enumerate(prompts)])
    return asyncio.run(run())


@pytest.mark.parametrize("share_prefill", [True, False])
def test_the_engine_records_the_experts_of_every_position_it_ran(share_prefill):
    model = moe()
    engine = HFEngine(model, eos_token_ids=[], record_routing=True, share_prefill=share_prefill,
                      static_cache=True)
    assert not engine.static_cache  # recording takes the dynamic path (graphs would skip the hooks)
    prompts = [[3, 4, 5, 6, 7]] * 3 + [[9, 10], [11, 12, 13]]
    gens = generate(engine, prompts, 9)
    calls: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, o: calls.append(o[2])) for r in moe_routers(model)]
    for prompt, gen in zip(prompts, gens):
        routing = gen.extra["routing"]
        assert routing.dtype == torch.uint8 and routing.shape == (len(prompt) + len(gen.token_ids) - 1, 2, 2)
        calls.clear()
        with torch.no_grad():
            model(torch.tensor([prompt + gen.token_ids]))
        full = torch.stack(calls, dim=1)[: routing.shape[0]]  # one sequence alone: the trainer's view
        assert torch.equal(full.sort(-1).values, routing.long().sort(-1).values)
    for hook in hooks:
        hook.remove()


def test_each_position_keeps_the_routing_of_the_turn_that_ran_it_first():
    sample = Sample(0, [], None, [1, 2, 3], [0, 0, 0], [0.0] * 3)
    first = torch.arange(4 * 2).view(4, 1, 2)  # turn 1: prompt 3 + sampled 2, the last never fed back
    record_routing(sample, first)
    second = torch.full((7, 1, 2), 99)  # turn 2's prefill reran positions 0..3: they keep turn 1's
    record_routing(sample, second)
    assert torch.equal(sample.routing[:4], first) and torch.equal(sample.routing[4:], second[4:])
    record_routing(sample, None)  # an engine that does not record
    assert sample.routing.shape[0] == 7


def test_sample_routes_replay_sampled_positions_or_all_of_them():
    spec = RoutingSpec(1, 1, 4)
    recorded = torch.tensor([0, 1, 2, 3, 0, 1]).view(6, 1, 1)  # positions 0..5 ran
    mask = [0, 0, 1, 1, 0, 1, 1, 1]  # prompt 2, sampled 2, a tool token, sampled 3
    response = sample_routes(recorded, mask, "response", spec)
    assert response.shape == (7, 1, 1) and response.dtype == torch.uint8
    assert response.view(-1).tolist() == [255, 255, 2, 3, 255, 1, 255]  # position 6 never ran
    assert sample_routes(recorded, mask, "all", spec).view(-1).tolist() == [0, 1, 2, 3, 0, 1, 255]
    assert sample_routes(None, mask, "all", spec).view(-1).tolist() == [255] * 7


def test_the_balance_loss_is_transformers_and_a_float64_reference():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = moe()
    balance = RouterBalance(model)
    ids = torch.randint(0, 64, (1, 23))
    out = model(ids, output_router_logits=True)
    rows = 19  # the last 4 positions are padding: left out
    ours = balance.loss(rows, rows)
    theirs = load_balancing_loss_func(tuple(l[:rows] for l in out.router_logits), 8, 2)
    assert torch.allclose(ours, theirs, atol=1e-6)
    # float64: E * sum_e (share of top-k choices on e) * (mean probability of e), over layers together
    probs = [torch.softmax(l[:rows].double(), -1) for l in out.router_logits]
    counts = sum(torch.bincount(p.topk(2).indices.reshape(-1), minlength=8).double() for p in probs)
    mean_p = sum(p.sum(0) for p in probs)
    total = rows * len(probs)
    assert math.isclose(float(ours.detach()), float(8 * ((counts / total) * (mean_p / total)).sum()), rel_tol=1e-5)
    ours.backward()
    assert all(r.weight.grad.abs().sum() > 0 for r in moe_routers(model))
    with torch.no_grad():
        model(ids)
    assert float(balance.loss(0, 0)) == 0.0  # a padding pack: no real position
    with pytest.raises(RuntimeError, match="0 router calls in the forward, expected 2"):
        balance.loss(rows, rows)  # the calls were taken: a loss needs a forward of its own
