"""Expert parallelism's per-class expert math (train/parallel/expert_parallel.py EXPERT_RULES) is each class's own
forward: rows grouped by expert through the rule equal the module's forward of each row alone with that expert
(top-1, weight 1), for every mixture-of-experts family of the matrix. Which classes are known, and the refusal."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from model_families import COMMON, FAMILIES, MIXTURES
from train.parallel.expert_parallel import EXPERT_RULES, _rule_name, ep_refusal, expert_modules


def family_config(family: str):
    model_type, overrides, _ = FAMILIES[family]
    return AutoConfig.for_model(model_type, **{**COMMON, **overrides})


@pytest.mark.parametrize("family", MIXTURES)
def test_each_rule_is_its_expert_classes_own_forward(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family))
    [experts, *_] = expert_modules(model)
    for p in experts.parameters():  # random biases too (GPT-OSS), so that every term counts
        torch.nn.init.normal_(p, std=0.2)
    counts = [3, 0, 5, 1]  # rows per expert, expert 1 none
    rows = torch.randn(sum(counts), model.config.hidden_size)
    which = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    weights = dict(experts.named_parameters(recurse=False))
    got = EXPERT_RULES[_rule_name(experts)](experts, rows, counts, weights)
    want = experts(rows, which[:, None], torch.ones(len(rows), 1))
    assert torch.equal(got, want)


def test_dense_and_unknown_experts_are_refused_by_name():
    assert ep_refusal(family_config("qwen3_moe")) is None
    assert "has no fused routed experts" in ep_refusal(family_config("llama3"))
    assert set(EXPERT_RULES) >= {"Qwen3MoeExperts", "Qwen2MoeExperts", "OlmoeExperts", "MixtralExperts", "GptOssExperts"}
    deepseek = AutoConfig.for_model("deepseek_v3", vocab_size=512, hidden_size=64, intermediate_size=128,
                                    moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                    first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
                                    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    reason = ep_refusal(deepseek)
    assert reason is not None and "DeepseekV3Experts is not one" in reason, reason
