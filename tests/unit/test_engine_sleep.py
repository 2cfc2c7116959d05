"""rollout.sleep (train/trainer/engine_sleep.py): the engine sleeps through an update only where the update's
planned memory does not fit beside it, every rank decides alike, and each change of mind is said once."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from train.models.trainable import Trainable
from train.models.memory_plan import GIB, count_parameters, preset_config, working_bytes
from train.parallel.layout import Sizes
from train.trainer.engine_sleep import EngineSleep

CPU = SimpleNamespace(device=torch.device("cpu"))
CUDA = SimpleNamespace(device=torch.device("cuda"))  # only its type is read: nothing touches a GPU
TOKENS = 20000  # this rank's tokens of the step batch (one process: the batch's)


def policy(asked, working, free):
    return EngineSleep(asked, lambda tokens: working, CPU, lambda: free)


def test_null_keeps_the_engine_awake_while_the_free_memory_covers_the_update_with_headroom():
    free = {"now": 20 * GIB}
    sleep = EngineSleep(None, lambda tokens: 10 * GIB, CPU, lambda: free["now"])
    assert sleep.decide(TOKENS)[0] is False
    free["now"] = 10.5 * GIB  # under 10 GiB + 10%
    went, line = sleep.decide(TOKENS)
    assert went is True and "GiB short" not in line and "0.5 GiB more than the tightest rank has free" in line
    free["now"] = 11.5 * GIB
    assert sleep.decide(TOKENS)[0] is False


def test_a_decision_is_said_once_and_again_only_when_it_changes():
    free = {"now": 20 * GIB}
    sleep = EngineSleep(None, lambda tokens: 10 * GIB, CPU, lambda: free["now"])
    first = sleep.decide(TOKENS)
    assert first[0] is False and first[1].startswith("the engine stays awake through the update")
    assert sleep.decide(TOKENS) == (False, None)
    free["now"] = GIB
    went, line = sleep.decide(TOKENS)
    assert went and line.startswith("the engine sleeps during the update")
    assert sleep.decide(TOKENS) == (True, None)


@pytest.mark.parametrize("asked", [True, False])
def test_true_and_false_hold_whatever_the_memory(asked):
    for free in (0, 10**15):
        sleep = policy(asked, 10 * GIB, free)
        assert sleep.decide(TOKENS)[0] is asked
    assert f"rollout.sleep={str(asked).lower()}" in EngineSleep(asked, None, CPU, lambda: 0).decide(TOKENS)[1]


def test_null_on_a_cpu_sleeps_as_before_and_says_nothing():
    actor = SimpleNamespace(update_working_bytes=lambda: pytest.fail("no estimate is asked for on a CPU"))
    sleep = EngineSleep.of(None, CPU, "hf", actor, None)
    assert sleep.working is None and sleep.decide(TOKENS) == (True, None)


def model(working):
    return SimpleNamespace(update_working_bytes=lambda tokens=None: working)


@pytest.mark.parametrize("kind,critic,working,want,why", [
    ("hf", None, 3 * GIB, 3 * GIB, None),
    ("hf", model(2 * GIB), 3 * GIB, 5 * GIB, None),  # a critic's update as well: the two added
    ("hf", None, None, None, "no memory estimate"),
    ("hf", model(None), 3 * GIB, None, "no memory estimate"),
    ("sglang", None, 3 * GIB, None, "sglang engine keeps its KV pool"),
    ("remote", None, 3 * GIB, None, None),  # a rollout rank's engine: its sleep is a no-op, nothing to decide
])
def test_null_on_a_gpu_estimates_an_hf_engine_beside_the_models_that_update(kind, critic, working, want, why):
    sleep = EngineSleep.of(None, CUDA, kind, model(working), critic)
    assert (sleep.working(TOKENS) if want is not None else sleep.working) == want
    assert (sleep.unestimated is None) == (why is None)
    if why is not None:
        assert why in sleep.unestimated


def fake_actor(**changes):
    """A Trainable with what update_working_bytes and _recompute_limit read (no model built), for a
    Qwen2.5-0.5B-shaped actor on one GPU after its first step (the fused head: no logits)."""
    base = dict(device=torch.device("cuda"), model=SimpleNamespace(config=preset_config("qwen2.5-0.5b")),
                optimizer=SimpleNamespace(state={"moments": "allocated"}),
                layout=SimpleNamespace(sizes=Sizes(ddp=1, fsdp=1, tp=1, sp=1, dp=1)),
                cfg=SimpleNamespace(gradient_checkpointing=True), offload_model=False, offload_optimizer=False,
                max_tokens=16384, infer_tokens=32768, lora=SimpleNamespace(rank=0), keeps_logits=False,
                masters=SimpleNamespace(sums_held=False), recompute_above=None, _counts=None)
    base.update(changes)
    actor = Trainable.__new__(Trainable)
    actor.__dict__.update(base)
    return actor


def test_the_actors_working_bytes_are_its_gradients_and_activations_at_its_longest_micro_batch():
    config = preset_config("qwen2.5-0.5b")
    params, _ = count_parameters(config)
    seq, h, layers, inter, heads, kv, hd, vocab = 32768, 896, 24, 4864, 14, 2, 64, 151936

    def layer_set(tokens):  # one layer's recomputed working set
        return int(1.5 * (4 * h + 3 * heads * hd + 3 * kv * hd + 5 * inter) * tokens * 2)

    def fused_head(tokens):  # a 2048-token chunk's logits as they are cast to float32, 6 bytes per entry (forward),
        # or its float32 gradient as it is cast, with the tied head's fp32 gradient and the hidden states' (backward)
        chunk = min(tokens, 2048)
        return 6 * chunk * vocab + 4 * vocab * h + 2 * tokens * h

    # fp32 gradient sums and the backward's bf16 gradients; every layer's bf16 input; then the larger of one
    # layer's working set and the head's backward (which runs first, before any layer recomputes)
    want = 6 * params + layers * seq * h * 2 + max(layer_set(seq), fused_head(seq))
    assert Trainable.update_working_bytes(fake_actor()) == want
    assert working_bytes(config, seq=seq, lora_rank=0, fused_head=True, checkpointing=True,
                         master_weights=True) == want
    # FSDP2 over one rank instead: 4-byte gradients, and the largest group (the embeddings) unsharded, bf16 + fp32
    fsdp = Trainable.update_working_bytes(fake_actor(masters=None))
    assert fsdp == want - 2 * params + vocab * h * 6
    # the plain head: 16 bytes per token and vocabulary entry (a critic's value head keeps none)
    assert Trainable.update_working_bytes(fake_actor(keeps_logits=True)) == (
        6 * params + layers * seq * h * 2 + 16 * seq * vocab + 2 * seq * h)
    # a step batch of 8,192 tokens over all ranks makes no longer pack; one of more is held to the configured length
    short = 6 * params + layers * 8192 * h * 2 + max(layer_set(8192), fused_head(8192))
    assert fake_actor().update_working_bytes(tokens=8192) == short < want
    assert fake_actor().update_working_bytes(tokens=10**6) == want


def test_the_masters_gradient_sums_count_until_the_first_backward_allocates_them():
    """The fp32 gradient sums of actor.master_weights (4 bytes per trainable parameter) stay allocated from the
    first backward on, as the moments do from the first step: free memory read after that already lacks them."""
    params, _ = count_parameters(preset_config("qwen2.5-0.5b"))
    before = Trainable.update_working_bytes(fake_actor())
    assert before - Trainable.update_working_bytes(fake_actor(masters=SimpleNamespace(sums_held=True))) == 4 * params
    from train.models.master_weights import MasterWeights

    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    masters = MasterWeights(model, torch.bfloat16)
    assert not masters.sums_held
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    masters.collect()
    assert masters.sums_held


def test_packs_skip_the_recompute_only_as_far_as_the_memory_free_at_the_update_allows():
    """_recompute_limit, which the update's packing asks with the least free memory of any rank: the longest
    multiple of 1024, up to recompute_above, whose update without recompute (every layer's working set kept) plus
    10% fits; 0 (every pack recomputes) where not even 1024 do; recompute_above itself where the plan does not
    cover the update (it was chosen for such a model at build time)."""
    params, _ = count_parameters(preset_config("qwen2.5-0.5b"))
    h, layers, inter, heads, kv, hd, vocab = 896, 24, 4864, 14, 2, 64, 151936

    def need(seq: int) -> float:  # fp32 gradient sums and bf16 gradients; every layer's working set; the fused head
        chunk = min(seq, 2048)
        head = 6 * chunk * vocab + 4 * vocab * h + 2 * seq * h  # the backward's (the forward's 6 per entry is less)
        return (6 * params + layers * int(1.5 * (4 * h + 3 * heads * hd + 3 * kv * hd + 5 * inter) * seq * 2)
                + head) * 1.1

    actor = fake_actor(recompute_above=30720)
    assert actor._recompute_limit(10**13) == 30720
    assert actor._recompute_limit(math.ceil(need(20480))) == 20480
    assert actor._recompute_limit(math.ceil(need(20480)) - 1) == 19456
    assert actor._recompute_limit(math.ceil(need(1024)) - 1) == 0
    assert fake_actor(recompute_above=30720, offload_model=True)._recompute_limit(0) == 30720  # (not planned)
    assert fake_actor(recompute_above=1500)._recompute_limit(10**13) == 1500  # not a multiple of 1024 itself


def test_a_pack_recomputes_when_its_place_is_over_the_limit_on_any_rank(monkeypatch):
    """_mark_recompute on a GPU (its collective and free memory faked: this rank's pack lengths, and the
    other rank's longer second pack and less free memory): one all-reduce gives each place's longest pack and
    the least free memory; the limit comes from that memory, and the step's limit and share of recomputed packs
    are kept for the metrics."""
    import train.models.trainable as trainable

    actor = fake_actor(recompute_above=30720)
    other_rank = [8192.0, 24576.0, 2048.0, -20 * GIB]

    def all_reduce_max_many(values, device):
        assert device.type == "cuda"
        return [max(a, b) for a, b in zip(values, other_rank)]

    monkeypatch.setattr(trainable, "all_reduce_max_many", all_reduce_max_many)
    monkeypatch.setattr(trainable, "free_device_bytes", lambda device: 70 * GIB)
    packs = [[SimpleNamespace(total_len=16384, recompute=True), SimpleNamespace(total_len=4096, recompute=True)],
             [SimpleNamespace(total_len=1024, recompute=True)]]
    actor._mark_recompute(packs)
    limit = actor._recompute_limit(20 * GIB)  # the other rank's free memory decides
    assert 4096 < limit < 16384  # this rank alone (70 GiB) would have let its 16,384-token pack keep its activations
    assert actor._recompute_limit(70 * GIB) >= 16384
    assert [mb.recompute for part in packs for mb in part] == [True, True, False]
    assert actor.recompute_stats == (limit, 2 / 3)


def test_under_sequence_parallelism_a_pack_is_measured_by_what_one_device_holds(monkeypatch):
    """A packed row is split over the sp ranks: the limit (tokens per device) is held against its share."""
    import train.models.trainable as trainable

    actor = fake_actor(recompute_above=10240, layout=SimpleNamespace(sizes=Sizes(ddp=1, fsdp=1, tp=1, sp=2, dp=1)))
    monkeypatch.setattr(trainable, "all_reduce_max_many", lambda values, device: values)
    monkeypatch.setattr(trainable, "free_device_bytes", lambda device: 70 * GIB)
    packs = [[SimpleNamespace(total_len=16384, recompute=True), SimpleNamespace(total_len=24576, recompute=True)]]
    actor._mark_recompute(packs)
    assert [mb.recompute for mb in packs[0]] == [False, True]  # 8,192 and 12,288 tokens on each of the 2 devices


def test_the_engines_weights_are_reserved_where_it_stays_awake_through_the_update():
    """grpo.awake_engine_bytes, which the trainer hands the actor: the hf engine's own weights (in rollout.dtype)
    where the configuration keeps it awake through the update; nothing where it borrows the actor's; None where it
    sleeps when needed, runs on rollout ranks, or is SGLang."""
    from conftest import STUB_MODEL, run_config
    from train.models.shared_base import share_base_refusal
    from train.trainer.grpo import awake_engine_bytes, plans_on_borrowing

    params, _ = count_parameters(AutoConfig.from_pretrained(STUB_MODEL))

    def engine(**overrides):  # as the trainer asks it
        cfg = run_config(overrides)
        borrows = plans_on_borrowing(share_base_refusal(cfg, 1, "cpu"), cfg.rollout, cfg.actor)
        found = awake_engine_bytes(cfg.rollout, "cpu", str(STUB_MODEL), borrows)
        return None if found is None else found()

    assert engine() is None and engine(**{"rollout.sleep": True}) is None  # null: it sleeps when the update needs it
    assert engine(**{"rollout.sleep": False}) == engine(**{"rollout.max_staleness": 1}) == 4 * params  # fp32 on CPU
    assert engine(**{"rollout.sleep": False, "rollout.dtype": "bfloat16"}) == 2 * params
    assert engine(**{"rollout.max_staleness": 1, "rollout.ranks": 1}) is None
    lora = {"rollout.sleep": False, "actor.lora.rank": 4}
    assert share_base_refusal(run_config(lora), 1, "cpu") is None and engine(**lora) == 0  # it borrows the base
    assert engine(**lora, **{"rollout.share_actor_base": False}) == 4 * params
    # a bf16 full fine-tune lends its weights only with masters: null ones may come out off, so the plan counts them
    full = {"rollout.sleep": False, "actor.dtype": "bfloat16", "rollout.dtype": "bfloat16"}
    assert share_base_refusal(run_config(full), 1, "cpu") is None and engine(**full) == 2 * params
    assert engine(**full, **{"actor.master_weights": True}) == 0


def test_null_sizes_the_update_by_the_step_batchs_tokens_over_all_ranks():
    seen = []
    sleep = EngineSleep(None, lambda tokens: seen.append(tokens) or GIB, CPU, lambda: 2 * GIB)
    went, line = sleep.decide(TOKENS)
    assert went is False and seen == [TOKENS]  # (one process: the sum over ranks is its own)
    assert f"the update of {TOKENS} tokens needs 1.1 GiB" in line


def test_before_the_first_optimizer_step_the_moments_it_will_allocate_count_too():
    """Fused AdamW allocates its two fp32 moments at the first step: free memory read before it overstates the
    room by 8 bytes per trainable parameter (48 GiB for a 4B full fine-tune), so the first update counts them."""
    actor = fake_actor(optimizer=SimpleNamespace(state={}))
    params, _ = count_parameters(preset_config("qwen2.5-0.5b"))
    first = Trainable.update_working_bytes(actor)
    actor.optimizer.state["moments"] = "allocated"
    assert first - Trainable.update_working_bytes(actor) == 8 * params


@pytest.mark.parametrize("change", [
    dict(device=torch.device("cpu")), dict(optimizer=None), dict(layout=SimpleNamespace(sizes=Sizes(1, 1, 2, 1, 1))),
    dict(layout=SimpleNamespace(sizes=Sizes(1, 2, 1, 2, 1))), dict(offload_model=True),
    dict(layout=SimpleNamespace(sizes=Sizes(ddp=1, fsdp=2, tp=1, sp=1, dp=2, ep=2))),
    dict(model=SimpleNamespace(config=SimpleNamespace(vision_config={"depth": 32}, model_type="qwen2_5_vl"))),
], ids=["cpu", "reference", "tp", "sp", "offload", "expert_parallel", "vision"])
def test_no_estimate_where_the_plan_does_not_cover_the_update(change):
    assert Trainable.update_working_bytes(fake_actor(**change)) is None


def test_offloaded_moments_are_planned_as_one_bucket_in_the_step_and_none_before_the_first():
    """actor.offload_optimizer: the moments never stay on the device (optim.HostMoments), so neither the first
    update nor a later one adds them; the step brings one bucket of them over beside the gradients. A 4B full
    fine-tune at 1,024 tokens: its backward's working set is the larger, as without offload less the moments."""
    from train.models.memory_plan import MOMENT_BUCKET_BYTES, plan

    config = preset_config("qwen3-4b")
    kw = dict(model=SimpleNamespace(config=config), max_tokens=1024, infer_tokens=1024, masters=None)
    kept, offloaded = fake_actor(**kw), fake_actor(offload_optimizer=True, **kw)
    params, _ = count_parameters(config)
    p = plan(config, seq=1024)
    backward = 4 * params + p.activations + p.unshard  # gradients, activations, unshard (no masters here)
    assert Trainable.update_working_bytes(kept) == Trainable.update_working_bytes(offloaded) == backward
    for actor in (kept, offloaded):
        actor.optimizer = SimpleNamespace(state={})  # before the first optimizer step
    assert Trainable.update_working_bytes(kept) == backward + 8 * params
    assert Trainable.update_working_bytes(offloaded) == backward  # the moments are made on the host side
    tiny = fake_actor(offload_optimizer=True, **{**kw, "max_tokens": 1, "infer_tokens": 1})
    step = 4 * params + MOMENT_BUCKET_BYTES  # at one token the step's gradients and bucket are the peak
    assert Trainable.update_working_bytes(tiny) == max(step, 4 * params + plan(config, seq=1).activations
                                                        + plan(config, seq=1).unshard)


def test_a_mixture_of_experts_is_estimated_with_each_tokens_top_k_expert_copies():
    """A Qwen3-30B-A3B-shaped actor (128 experts, top-8 of width 768): every layer's working set counts each of
    a token's 8 copies (its input and weighted output, 5 x the expert's width) and the router's fp32 logits and
    probabilities, in place of the dense 5 x intermediate_size."""
    from train.models.memory_plan import preset_config as preset

    config = preset("qwen3-30b-a3b")
    params, _ = count_parameters(config)
    seq, h, layers, heads, kv, hd = 16384, 2048, 48, 32, 4, 128
    mlp = 8 * (2 * h + 5 * 768) + 4 * 128  # > 5 x 6144, the dense width Qwen3-MoE's config also names
    want = 6 * params + layers * seq * h * 2 + int(1.5 * (4 * h + 3 * heads * hd + 3 * kv * hd + mlp) * seq * 2)
    actor = fake_actor(model=SimpleNamespace(config=config), max_tokens=seq, infer_tokens=seq)
    assert Trainable.update_working_bytes(actor) == want
