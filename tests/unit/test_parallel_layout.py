"""Parallel layout sizes: derived sizes, and a clear error naming the key for every size that cannot
be laid out on the world or on the model (before any model loads)."""
import pytest
from transformers import LlamaConfig

from conftest import compose_config
from train.trainer.config import ConfigError, load, role_config, validate
from train.parallel.layout import LayoutError, Sizes, check_model_fits, layout_sizes


def test_sizes_are_derived_from_the_world():
    assert layout_sizes(8, ddp=2, tp=2, sp=2) == Sizes(ddp=2, fsdp=2, tp=2, sp=2, dp=2)
    assert layout_sizes(4, tp=2) == Sizes(ddp=1, fsdp=2, tp=2, sp=1, dp=2)
    assert layout_sizes(1) == Sizes(ddp=1, fsdp=1, tp=1, sp=1, dp=1)
    assert layout_sizes(16, ddp=4, sp=4) == Sizes(ddp=4, fsdp=4, tp=1, sp=4, dp=4)
    assert layout_sizes(8, ddp=2, ep=2) == Sizes(ddp=2, fsdp=4, tp=1, sp=1, dp=8, ep=2)  # experts: efsdp = 2
    ring = layout_sizes(8, cp=4)  # a row split over 4 ranks: 2 data-parallel groups
    assert ring == Sizes(ddp=1, fsdp=8, tp=1, sp=1, dp=2, cp=4) and ring.seq == 4
    assert layout_sizes(8, cp=2, sp=2).dp == 2  # Ulysses inside the ring: rows split over 4 ranks
    assert layout_sizes(8, cp=2, tp=2) == Sizes(ddp=1, fsdp=4, tp=2, sp=1, dp=2, cp=2)  # a ring per tp rank


@pytest.mark.parametrize("world,kwargs,pattern", [
    (4, {"tp": 3}, r"critic.tp_size=3 does not divide the 4 ranks"),
    (4, {"tp": 2, "sp": 4}, r"critic.sp_size=4 x critic.tp_size=2 does not divide the 4 ranks"),
    (8, {"tp": 2, "ddp": 3}, r"critic.ddp_size=3 does not divide the 4 data-parallel ranks"),
    (2, {"tp": 0}, r"critic.tp_size: must be a positive integer"),
    (8, {"ddp": 2, "ep": 8}, r"critic.ep_size=8 does not divide the 4 FSDP ranks \(world 8 / ddp_size 2 / tp_size 1\)"),
    (4, {"tp": 2, "ep": 2}, r"critic.ep_size=2 with critic.tp_size=2: .*set critic.tp_size=1"),
    (6, {"cp": 4}, r"critic.cp_size=4 x critic.sp_size=1 x critic.tp_size=1 does not divide the 6 ranks"),
    (4, {"cp": 2, "sp": 4}, r"critic.cp_size=2 x critic.sp_size=4 x critic.tp_size=1 does not divide the 4 ranks"),
    (4, {"cp": 2, "sp": 2, "tp": 2}, r"critic.cp_size=2 x critic.sp_size=2 x critic.tp_size=2 does not divide the "
                                     r"4 ranks"),
])
def test_sizes_that_do_not_fit_the_world_name_the_key(world, kwargs, pattern):
    with pytest.raises(LayoutError, match=pattern):
        layout_sizes(world, prefix="critic", **kwargs)


def test_experts_must_split_over_ep():
    from transformers import Qwen3MoeConfig

    moe = Qwen3MoeConfig(num_experts=6, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16,
                         num_hidden_layers=1, vocab_size=512)
    check_model_fits(layout_sizes(4, ep=2), moe)
    with pytest.raises(LayoutError, match=r"actor.ep_size=4: 6 experts per layer do not split evenly"):
        check_model_fits(layout_sizes(4, ep=4), moe)
    with pytest.raises(LayoutError, match=r"actor.ep_size=2: LlamaConfig is not a mixture of experts; set actor.ep_size=1"):
        check_model_fits(layout_sizes(2, ep=2), llama(heads=8, kv=2))


def llama(heads=9, kv=3, vocab=49152):
    return LlamaConfig(num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, hidden_size=9 * 64)


def test_model_must_split_over_tp_and_sp():
    check_model_fits(layout_sizes(6, tp=3), llama())  # 9 heads / 3 kv heads over tp=3 is fine
    with pytest.raises(LayoutError, match=r"9 attention heads do not split over tp_size=2 x sp_size=1"):
        check_model_fits(layout_sizes(2, tp=2), llama())
    with pytest.raises(LayoutError, match=r"tp_size=1 x sp_size=2"):
        check_model_fits(layout_sizes(2, sp=2), llama())
    with pytest.raises(LayoutError, match=r"tp_size=4: 2 key/value heads"):
        check_model_fits(layout_sizes(4, tp=4), llama(heads=8, kv=2))
    with pytest.raises(LayoutError, match=r"vocabulary \(50001\)"):
        check_model_fits(layout_sizes(2, tp=2), llama(heads=8, kv=2, vocab=50001))


pytestmark = pytest.mark.usefixtures("in_repo_root")  # config paths are relative to the repo root


@pytest.mark.parametrize("overrides,world,pattern", [
    (["actor.tp_size=3"], 4, r"actor.tp_size=3 does not divide the 4 ranks"),
    (["actor.tp_size=8"], 8, r"actor: 4 attention heads do not split over tp_size=8.*\(model stub/model\)"),
    (["actor.sp_size=2", "actor.tp_size=4"], 8, r"4 attention heads do not split over tp_size=4 x sp_size=2"),
    (["adv.estimator=gae", "critic.ddp_size=3"], 4, r"critic.ddp_size=3 does not divide"),
    (["actor.kl.coef=0.1", "ref_actor.tp_size=3"], 4, r"ref_actor.tp_size=3 does not divide"),
    (["actor.offload_model=yes"], 2, r"'actor.offload_model': expected true or false"),
    # compiled layers under tensor parallelism trained the embeddings wrong (dist_checks.py grads --tp 2 --compile)
    (["actor.compile=true", "actor.tp_size=2"], 2, r"'actor.compile': compiled layers under tensor parallelism"),
    (["actor.compile=true", "actor.kl.coef=0.1", "ref_actor.tp_size=2"], 2, r"'actor.compile'.*actor.compile=false"),
    (["adv.estimator=gae", "critic.compile=true", "critic.tp_size=2"], 2, r"'critic.compile'"),
])
def test_config_checks_each_models_layout(overrides, world, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(compose_config(overrides), world_size=world)


def test_valid_layouts_pass_and_the_reference_mirrors_the_actor():
    cfg = compose_config(["actor.tp_size=2", "actor.sp_size=2", "actor.kl.coef=0.1", "ref_actor.sp_size=1"])
    validate(cfg, world_size=4)
    validate(compose_config(["actor.compile=true", "actor.sp_size=2", "actor.cp_size=2"]), world_size=4)
    ref = role_config(load(cfg), "ref_actor")
    assert (ref.tp_size, ref.sp_size) == (2, 1)  # tp from the actor, sp overridden


def test_ring_attention_refuses_attention_sinks_and_the_balance_loss_by_key(tmp_path):
    from transformers import AutoConfig

    from model_families import COMMON, FAMILIES, build

    model_type, overrides, _ = FAMILIES["gpt_oss"]
    with pytest.raises(LayoutError, match=r"actor.cp_size=2: ring attention has no attention-sink column"):
        check_model_fits(layout_sizes(2, cp=2), AutoConfig.for_model(model_type, **{**COMMON, **overrides}))
    moe = build("qwen3_moe", tmp_path / "moe")
    with pytest.raises(ConfigError, match=r"'actor.router_aux_loss_coef': .*ring attention.*actor.router_aux_loss_coef=0"):
        validate(compose_config([f"actor.model_name={moe}", "actor.cp_size=2", "actor.router_aux_loss_coef=0.01"]),
                 world_size=2)
