"""train/models/memory_plan.py: parameter counts are the model's own, and the estimate reproduces the
peaks measured on one GPU (benchmarks/gpu_suite.py --only bigmodel)."""
import dataclasses
import json

import pytest
import torch

from conftest import ROOT, run_config
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


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_critics_parameters_are_its_backbone_and_value_head(lora_rank):
    """The critic (train/models/value_model.py) has no LM head: an untied model's [vocab, hidden] matrix is not
    its to keep (16 bytes per parameter in the actor's reserve, resident_bytes)."""
    from transformers import AutoModel, LlamaConfig

    from train.models.lora import LoraSettings, apply_lora, is_adapter
    from train.models.memory_plan import resident_bytes
    from train.models.value_model import ValueModel

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    critic = ValueModel(AutoModel.from_config(config))
    if lora_rank:
        apply_lora(critic.model, LoraSettings(rank=lora_rank, alpha=8.0))
    adapters = sum(p.numel() for n, p in critic.named_parameters() if is_adapter(n))
    params = sum(p.numel() for p in critic.parameters()) - adapters
    assert count_parameters(config, lora_rank, value_head=True) == (params, adapters)
    assert count_parameters(config, lora_rank)[0] == params + 300 * 64 - 65  # the actor: its LM head, no value head
    assert resident_bytes(config, trainable=True, value_head=True) == 16 * params
    assert plan(config, seq=1024, lm_head=False).params == params


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


def test_a_push_holds_two_buckets_of_what_it_sends():
    """The push's gather fills one flat bucket while the engine copies from the last one: two buckets of
    `rollout.bucket_size_mb`, or the bytes sent (bf16) when they are fewer: LoRA sends its adapters only."""
    full = plan(preset_config("qwen3-4b"), seq=16384)
    assert full.push_buffers == 2 * 512 * 2**20
    assert full.push_peak == full.weights + full.optimizer + full.engine_weights + 2 * 512 * 2**20
    assert plan(preset_config("qwen3-4b"), seq=16384, bucket_mb=64).push_buffers == 2 * 64 * 2**20
    lora = plan(preset_config("qwen2.5-0.5b"), seq=16384, lora_rank=8)
    assert lora.push_buffers == 2 * 2 * lora.adapters < 2 * 512 * 2**20
    tiny_kv = plan(preset_config("qwen2.5-0.5b"), seq=1024, replies=1, prompt=64, new=64)
    assert tiny_kv.push_peak > tiny_kv.rollout_peak and tiny_kv.peak >= tiny_kv.push_peak


def test_master_weights_hold_the_bf16_copies_and_gradients_whole_and_unshard_nothing():
    """actor.master_weights on one GPU: 2 bytes more per trainable parameter for the bf16 weights, 2 for the
    backward's bf16 gradients, no FSDP unshard; with LoRA only the adapters have masters. The null rule takes it
    where that plan fits the free memory."""
    from train.models.memory_plan import HEADROOM, master_weights_fit

    config = preset_config("qwen3-4b")
    for rank in (0, 32):
        fsdp, masters = (plan(config, seq=16384, lora_rank=rank, master_weights=m) for m in (False, True))
        trainable = masters.adapters if rank else masters.params
        assert masters.weights == fsdp.weights + 2 * trainable and masters.gradients == fsdp.gradients + 2 * trainable
        assert masters.unshard == 0 < fsdp.unshard and masters.optimizer == fsdp.optimizer
        # the engine borrows the actor's bf16 weights: a LoRA base as before, now a full fine-tune's too
        assert masters.engine_weights == 2 * masters.adapters
        assert fsdp.engine_weights == (2 * fsdp.adapters if rank else 2 * fsdp.params)  # fp32 weights: its own copy
    need = plan(config, seq=16384, master_weights=True).update_peak * HEADROOM
    kw = dict(seq=16384, lora_rank=0, fused_head=True, checkpointing=True)
    assert master_weights_fit(config, free_bytes=int(need) + 1, **kw)
    assert not master_weights_fit(config, free_bytes=int(need) - 1, **kw)
    assert master_weights_fit(config, free_bytes=int(need) - 1, offload_optimizer=True, **kw)  # moments on the host


def test_the_command_prints_a_plan_and_names_what_it_does_not_know(capsys):
    assert main(["--model", "qwen2.5-0.5b", "--lora-rank", "8", "--seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-0.5b" in out and "LoRA rank 8" in out and "fits" in out
    # without checkpointing: the longest micro-batch each card holds (recompute_above's rule), up to --seq
    from train.models.memory_plan import recompute_above

    assert main(["--model", "qwen3-4b", "--lora-rank", "32", "--seq", "65536", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["no_recompute_up_to"]
    assert plain == {card: recompute_above(preset_config("qwen3-4b"), length=65537, fused_head=True, lora_rank=32,
                                           free_bytes=int(gib * GIB)) for card, gib in CARDS.items()}
    assert plain["80 GB (H100)"] < plain["141 GB (H200)"] <= 65536
    # an entropy bonus: the plain head's backward holds the entropy's graph too (5 bytes per token and entry)
    args = ["--model", "qwen3-4b", "--lora-rank", "32", "--seq", "4096", "--json", "--plain-head"]
    assert main(args) == 0 and main(args + ["--entropy"]) == 0
    without, with_bonus = (json.loads(line)["activations"] for line in capsys.readouterr().out.splitlines())
    assert with_bonus - without == 5 * 4096 * 151936 == (
        plan(preset_config("qwen3-4b"), seq=4096, lora_rank=32, fused_head=False, entropy=True).activations - without)
    assert main(["--model", "qwen2.5-0.5b", "--seq", "65536"]) == 0
    small = recompute_above(preset_config("qwen2.5-0.5b"), length=65537, fused_head=True,
                            free_bytes=int(CARDS["80 GB (H100)"] * GIB))
    assert f"without checkpointing (the update alone, engine asleep): micro-batches up to {small} tokens on 80 GB" in (
        capsys.readouterr().out)
    with pytest.raises(ValueError, match="neither a preset"):
        load_config("no-such-model")
    assert set(PRESETS) >= {"llama3.1-8b", "qwen3-4b"}
    assert torch.get_default_device().type == "cpu"  # nothing was built on a real device


def test_docs_gpu_md_holds_the_current_table():
    """docs/gpu.md's "What fits on one GPU" table is this module's output (regenerate it with
    `.venv/bin/python -m train.models.memory_plan --table`)."""
    assert table() in (ROOT / "docs" / "gpu.md").read_text()


# actor.max_length_per_device / gradient_checkpointing / use_liger_kernel = null (issue 36 item 2)
def _fits(config, seq, *, head, ckpt, free, lora_rank=0, shards=1):
    return plan(config, seq=seq, lora_rank=lora_rank, fused_head=head, checkpointing=ckpt, shards=shards).update_peak \
        * 1.10 <= free


def test_null_memory_settings_on_cpu_are_the_old_defaults_and_set_ones_stay():
    from train.models.memory_plan import auto_settings

    auto = auto_settings(None, None, None, config=None, device_type="cpu", free_bytes=None)
    assert (auto.max_length_per_device, auto.gradient_checkpointing, auto.use_liger_kernel) == (4096, False, False)
    kept = auto_settings(8192, True, None, config=None, device_type="cpu", free_bytes=None)
    assert (kept.max_length_per_device, kept.gradient_checkpointing, kept.use_liger_kernel) == (8192, True, False)
    given = auto_settings(3000, False, True, config=preset_config("qwen3-4b"), device_type="cuda", free_bytes=GIB)
    assert (given.max_length_per_device, given.gradient_checkpointing, given.use_liger_kernel, given.note) == (
        3000, False, True, None)  # nothing null: nothing decided, even where it would not fit


@pytest.mark.parametrize("model,lora_rank", [("qwen3-4b", 0), ("llama3.1-8b", 32), ("qwen2.5-0.5b", 0)])
def test_on_a_gpu_the_micro_batch_is_the_longest_that_fits_with_the_head_and_checkpointing_it_needs(model, lora_rank):
    from train.models.memory_plan import auto_settings

    config, free = preset_config(model), int(CARDS["80 GB (H100)"] * GIB)
    auto = auto_settings(None, None, None, config=config, device_type="cuda", free_bytes=free, lora_rank=lora_rank)
    seq = auto.max_length_per_device
    assert seq % 1024 == 0 and 1024 <= seq <= 65536
    assert _fits(config, seq, head=True, ckpt=True, free=free, lora_rank=lora_rank)
    if seq < 65536:  # one more block of 1024 tokens would not fit
        assert not _fits(config, seq + 1024, head=True, ckpt=True, free=free, lora_rank=lora_rank)
    assert auto.use_liger_kernel == (seq >= 8192)
    # checkpointing only where the update does not fit without it
    assert auto.gradient_checkpointing == (not _fits(config, seq, head=auto.use_liger_kernel, ckpt=False, free=free,
                                                     lora_rank=lora_rank))
    assert f"max_length_per_device {seq} (chosen)" in auto.note and "GiB free" in auto.note


def test_the_fused_head_is_not_chosen_where_it_does_not_apply_and_a_short_batch_skips_checkpointing():
    from transformers import AutoConfig

    from train.models.memory_plan import auto_settings

    config, free = preset_config("qwen2.5-0.5b"), 79 * GIB
    assert not auto_settings(None, None, None, config=config, device_type="cuda", free_bytes=free,
                             tp_size=2).use_liger_kernel  # a vocabulary split over tp ranks
    capped = AutoConfig.for_model("gemma2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # final_logit_softcapping
    assert not auto_settings(None, None, None, config=capped, device_type="cuda", free_bytes=free).use_liger_kernel
    short = auto_settings(2048, None, None, config=config, device_type="cuda", free_bytes=free)
    assert (short.max_length_per_device, short.gradient_checkpointing, short.use_liger_kernel) == (2048, False, False)


def _fits_plain(config, seq, *, head, free, master_weights=False):
    return plan(config, seq=seq, fused_head=head, checkpointing=False,
                master_weights=master_weights).update_peak * 1.10 <= free


def test_with_checkpointing_chosen_the_micro_batches_that_fit_without_it_skip_the_recompute():
    """recompute_above: the longest multiple of 1024 below the chosen length whose update fits without
    checkpointing (the packs up to it keep their activations), computed with the master weights as decided;
    None where not even 1024 tokens fit without it."""
    from train.models.memory_plan import auto_settings, recompute_above

    config, free = preset_config("qwen2.5-0.5b"), int(CARDS["80 GB (H100)"] * GIB)
    auto = auto_settings(None, None, None, config=config, device_type="cuda", free_bytes=free)
    assert auto.gradient_checkpointing and auto.max_length_per_device == 65536  # the case the threshold is for
    head = auto.use_liger_kernel
    for masters in (False, True):
        above = recompute_above(config, length=auto.max_length_per_device, fused_head=head, free_bytes=free,
                                master_weights=masters)
        assert above % 1024 == 0 and 1024 <= above < auto.max_length_per_device
        assert _fits_plain(config, above, head=head, free=free, master_weights=masters)
        assert not _fits_plain(config, above + 1024, head=head, free=free, master_weights=masters)
    # masters hold 4 more bytes per parameter than they save in FSDP's unshard: no more tokens fit without recompute
    from train.models.memory_plan import update_need

    assert all(update_need(config, s, fused_head=head, checkpointing=False, master_weights=True)
               > update_need(config, s, fused_head=head, checkpointing=False) for s in (1024, 16384, 65536))
    assert (recompute_above(config, length=65536, fused_head=head, free_bytes=free, master_weights=True)
            <= recompute_above(config, length=65536, fused_head=head, free_bytes=free))
    assert recompute_above(config, length=65536, fused_head=head, free_bytes=6 * GIB) is None


SMALL = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {  # model type and shapes: dense, and mixtures of experts as each family names its widths
    "dense": ("qwen2", dict(intermediate_size=1024)),
    "qwen3_moe": ("qwen3_moe", dict(intermediate_size=1024, moe_intermediate_size=128, num_experts=64,
                                    num_experts_per_tok=8, head_dim=64)),
    "mixtral": ("mixtral", dict(intermediate_size=512, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(intermediate_size=1024, moe_intermediate_size=128, num_experts=16,
                                    num_experts_per_tok=4, shared_expert_intermediate_size=512)),
    "olmoe": ("olmoe", dict(intermediate_size=128, num_experts=16, num_experts_per_tok=4)),
    "gpt_oss": ("gpt_oss", dict(intermediate_size=128, num_local_experts=16, num_experts_per_tok=4, head_dim=64)),
}


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_without_checkpointing_the_plan_bounds_what_the_forward_keeps_for_the_backward(family, experts):
    """The estimate the recompute threshold and the engine's sleep stand on: every tensor a bf16 forward of one
    packed micro-batch through the actor's packed attention saves for its backward (counted once per storage,
    through autograd's saved-tensor hooks) fits the plan's activations without checkpointing (layers x one
    layer's working set), which is not loose by more than 2x either. Mixtures of experts under both of
    transformers' expert kernels (grouped_mm, its default, and the per-expert loop); GPT-OSS's sinks with one
    segment as long as the micro-batch (the plan's worst case). (CPU SDPA: a GPU's flash attention saves no
    more. The backward's transients are what the plan's 1.5 factor is for.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    from train.parallel.packing import build_packed
    from train.parallel.seq_parallel import install_packed_attention
    from train.parallel.tensor_parallel import expert_count

    kind, shapes = FAMILIES[family]
    config = AutoConfig.for_model(kind, **SMALL, **shapes)
    if experts != "grouped_mm" and not expert_count(config):
        pytest.skip("a dense model has no experts")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                             **({"experts_implementation": experts} if expert_count(config) else {}))
    install_packed_attention(model.train())
    seq, storages = 1024, {}
    ids = torch.randint(3, config.vocab_size, (seq,))
    inputs = build_packed([0], [ids], [torch.ones(seq - 1)], 0, torch.device("cpu")).model_inputs()

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.model(**inputs, use_cache=False)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # (a matmul saves its weight too)
    saved = sum(n for ptr, n in storages.items() if ptr not in weights)
    planned = plan(config, seq=seq, checkpointing=False, fused_head=True).activations
    assert planned / 2 < saved <= planned, (saved / 2**20, planned / 2**20)


def test_the_actor_sets_a_recompute_threshold_only_where_it_chose_checkpointing_on_a_gpu(tmp_path, monkeypatch):
    """recompute_threshold, which Actor.__init__ calls after the master weights: a threshold where a null
    gradient_checkpointing came out on for a training actor on a GPU (its free memory faked, less what the other
    models keep); none where checkpointing was set by hand, is off, on a CPU, or for a reference."""
    from types import SimpleNamespace

    import train.models.memory_settings as settings_module
    from train.models.memory_plan import recompute_above
    from train.models.memory_settings import BuildRoom, recompute_threshold

    config = preset_config("qwen2.5-0.5b")
    config.save_pretrained(tmp_path)  # config.json only: the rule reads shapes, no weights
    free = 60 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(settings_module, "all_reduce_max", lambda value, device: value)  # one rank
    cfg = run_config({"actor.dtype": "bfloat16", "actor.max_length_per_device": 65536,
                      "actor.gradient_checkpointing": True, "actor.use_liger_kernel": True,
                      "actor.master_weights": True}).actor
    gpu, cpu = SimpleNamespace(device=torch.device("cuda")), SimpleNamespace(device=torch.device("cpu"))
    layout = SimpleNamespace(sizes=SimpleNamespace(fsdp=1, tp=1, ep=1))

    def threshold(asked, ctx=gpu, train=True, reserved=0, moe=False, **changes):
        path = tmp_path / "moe" if moe else tmp_path
        return recompute_threshold(dataclasses.replace(cfg, **changes), asked, BuildRoom(ctx, str(path), reserved),
                                   layout, train)

    want = recompute_above(config, length=65536, fused_head=True, free_bytes=free, master_weights=True)
    assert want is not None and threshold(None) == want
    assert threshold(None, reserved=lambda: 8 * GIB) == recompute_above(
        config, length=65536, fused_head=True, free_bytes=free - 8 * GIB, master_weights=True) < want
    assert threshold(True) is None and threshold(None, gradient_checkpointing=False) is None
    assert threshold(None, ctx=cpu) is None and threshold(None, train=False) is None
    from transformers import AutoConfig

    moe = tmp_path / "moe"
    AutoConfig.for_model("qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16).save_pretrained(moe)
    # a mixture of experts is planned with its experts; under expert parallelism a rank's experts take others' tokens
    moe_config = AutoConfig.from_pretrained(moe)
    assert threshold(None, moe=True) == recompute_above(moe_config, length=65536, fused_head=True, free_bytes=free,
                                                        master_weights=True) is not None
    expert_parallel = SimpleNamespace(sizes=SimpleNamespace(fsdp=1, tp=1, ep=2))
    assert recompute_threshold(cfg, None, BuildRoom(gpu, str(moe)), expert_parallel, True) is None


def test_the_actor_build_reads_the_config_the_free_memory_and_the_others_bytes_once(tmp_path, monkeypatch):
    """decided_memory_settings, what Actor.__init__ calls: with every memory setting null on a GPU, its three
    decisions read the model's config once, make one all-reduce of the free memory and ask the other models'
    bytes once, and decide as the three functions do one by one."""
    from types import SimpleNamespace

    import transformers

    import train.models.memory_settings as settings_module
    from train.models.memory_settings import (BuildRoom, decided_memory_settings, recompute_threshold,
                                              with_master_weights, with_memory_settings)

    preset_config("qwen2.5-0.5b").save_pretrained(tmp_path)
    calls = {"config": 0, "all_reduce": 0, "reserved": 0}
    read = transformers.AutoConfig.from_pretrained

    def counted(key, fn):
        def call(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return call

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", counted("config", read))
    monkeypatch.setattr(settings_module, "all_reduce_max", counted("all_reduce", lambda value, device: value))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 80 * GIB))
    reserved = counted("reserved", lambda: 2 * GIB)
    cfg = run_config({"actor.dtype": "bfloat16"}).actor
    assert None in (cfg.max_length_per_device, cfg.gradient_checkpointing, cfg.master_weights)
    gpu = SimpleNamespace(device=torch.device("cuda"))
    layout = SimpleNamespace(sizes=SimpleNamespace(fsdp=1, tp=1, ep=1), fsdp_mesh=SimpleNamespace(size=lambda: 1))
    out, note, threshold = decided_memory_settings(cfg, BuildRoom(gpu, str(tmp_path), reserved), layout, True)
    assert calls == {"config": 1, "all_reduce": 1, "reserved": 1}
    one_by_one, _ = with_memory_settings(cfg, BuildRoom(gpu, str(tmp_path), reserved), layout, True)
    one_by_one = with_master_weights(one_by_one, BuildRoom(gpu, str(tmp_path), reserved), layout, True)
    assert out == one_by_one and out.master_weights and "(chosen)" in note
    assert threshold == recompute_threshold(one_by_one, None, BuildRoom(gpu, str(tmp_path), reserved), layout, True)
    assert (threshold is not None) == bool(out.gradient_checkpointing)  # chosen on: the short packs skip it
    cpu = SimpleNamespace(device=torch.device("cpu"))
    before = dict(calls)
    decided_memory_settings(cfg, BuildRoom(cpu, str(tmp_path), reserved), layout, True)
    assert calls["all_reduce"] == before["all_reduce"] and calls["reserved"] == before["reserved"]  # nothing on CPU


def test_beside_an_engine_awake_through_the_update_the_actor_plans_with_half_of_what_it_leaves(tmp_path, monkeypatch):
    """rollout.sleep=false or rollout.max_staleness >= 1: the engine generates while the actor updates, its weights
    stay and its static KV buffers take up to half of the memory free when it decodes. So the null settings are
    chosen for half of what is left after the other models and the engine's weights, and the line says so."""
    from types import SimpleNamespace

    import train.models.memory_settings as settings_module
    from train.models.memory_plan import auto_settings
    from train.models.memory_settings import BuildRoom, decided_memory_settings

    config = preset_config("qwen2.5-0.5b")
    config.save_pretrained(tmp_path)
    free, others, engine = 24 * GIB, 2 * GIB, GIB
    monkeypatch.setattr(settings_module, "all_reduce_max", lambda value, device: value)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    cfg = run_config({"actor.dtype": "bfloat16", "actor.master_weights": False}).actor
    gpu = SimpleNamespace(device=torch.device("cuda"))
    layout = SimpleNamespace(sizes=SimpleNamespace(fsdp=1, tp=1, ep=1), fsdp_mesh=SimpleNamespace(size=lambda: 1))
    asleep, _, _ = decided_memory_settings(cfg, BuildRoom(gpu, str(tmp_path), others), layout, True)
    awake, note, _ = decided_memory_settings(cfg, BuildRoom(gpu, str(tmp_path), others, lambda: engine), layout, True)
    half = (free - others - engine) // 2
    want = auto_settings(None, None, None, config=config, device_type="cuda", free_bytes=half)
    assert awake.max_length_per_device == want.max_length_per_device < asleep.max_length_per_device
    assert awake.gradient_checkpointing == want.gradient_checkpointing
    assert "half the memory the rollout engine leaves" in note and "1.0 GiB" in note


def test_sharding_and_offload_make_room_and_a_model_that_cannot_fit_is_named():
    from train.models.memory_plan import auto_settings

    config, free = preset_config("llama3.1-8b"), int(CARDS["80 GB (H100)"] * GIB)
    alone = auto_settings(None, None, None, config=config, device_type="cuda", free_bytes=free)
    assert alone.max_length_per_device == 1024 and "does not fit even so" in alone.note
    eight = auto_settings(None, None, None, config=config, device_type="cuda", free_bytes=free, shards=8)
    assert eight.max_length_per_device > 8192 and "does not fit" not in eight.note  # FSDP over 8 GPUs
    assert _fits(config, eight.max_length_per_device, head=True, ckpt=True, free=free, shards=8)
    offloaded = auto_settings(None, None, None, config=preset_config("qwen3-4b"), device_type="cuda", free_bytes=free,
                              offload_optimizer=True)
    kept = auto_settings(None, None, None, config=preset_config("qwen3-4b"), device_type="cuda", free_bytes=free)
    assert offloaded.max_length_per_device > kept.max_length_per_device  # Adam moments on the host


def test_the_actor_decides_null_settings_before_it_builds_the_model():
    """The function Actor.__init__ calls, on a typed ActorConfig and on an OmegaConf section (as benchmarks pass)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from train.models.memory_settings import BuildRoom, with_memory_settings

    section = OmegaConf.load(ROOT / "config" / "grpo.yaml").actor
    assert section.max_length_per_device is None and section.use_liger_kernel is None  # the shipped defaults
    ctx = SimpleNamespace(device=torch.device("cpu"))
    layout = SimpleNamespace(sizes=SimpleNamespace(fsdp=1, tp=1, ep=1))
    typed = run_config().actor
    for cfg in (section, typed):
        out, note = with_memory_settings(cfg, BuildRoom(ctx, str(ROOT / "stub" / "model")), layout, train=True)
        assert (out.max_length_per_device, out.gradient_checkpointing, out.use_liger_kernel) == (4096, False, False)
        assert cfg.max_length_per_device is None and "on cpu" in note  # a copy: the caller's config is unchanged


def test_the_actor_takes_master_weights_on_a_gpu_where_the_plan_with_them_fits(tmp_path, monkeypatch):
    """with_master_weights, the function Actor.__init__ calls after the memory settings: on a GPU (its free memory
    faked here) null is on when the plan with masters at the chosen settings, plus 10%, fits the free memory less
    what the other models keep; off otherwise; a set value stays; a reference and fp32 never hold masters."""
    from types import SimpleNamespace

    import train.models.memory_settings as settings_module
    from train.models.memory_plan import HEADROOM
    from train.models.memory_settings import BuildRoom, with_master_weights

    config = preset_config("qwen3-4b")
    config.save_pretrained(tmp_path)  # config.json only: the rule reads shapes, no weights
    need = int(plan(config, seq=16384, fused_head=True, checkpointing=True, master_weights=True).update_peak * HEADROOM)
    cfg = run_config({"actor.dtype": "bfloat16", "actor.max_length_per_device": 16384,
                      "actor.gradient_checkpointing": True, "actor.use_liger_kernel": True}).actor
    ctx = SimpleNamespace(device=torch.device("cuda"))
    layout = SimpleNamespace(fsdp_mesh=SimpleNamespace(size=lambda: 1), sizes=SimpleNamespace(tp=1))

    monkeypatch.setattr(settings_module, "all_reduce_max", lambda value, device: value)  # one rank

    def decided(free: int, reserved=0, **changes) -> bool:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
        section = dataclasses.replace(cfg, **changes)
        return with_master_weights(section, BuildRoom(ctx, str(tmp_path), reserved), layout, True).master_weights

    assert decided(need + 1) and not decided(need - 1)
    assert not decided(need + 1, reserved=lambda: 2)  # the reference's or the critic's bytes come off first
    assert decided(need - 1, master_weights=True) and not decided(need + 1, master_weights=False)
    assert not decided(need + 1, dtype="float32")
    assert not with_master_weights(cfg, BuildRoom(ctx, str(tmp_path)), layout, False).master_weights  # a reference
    wide = SimpleNamespace(fsdp_mesh=SimpleNamespace(size=lambda: 2), sizes=SimpleNamespace(tp=1))
    assert not with_master_weights(cfg, BuildRoom(ctx, str(tmp_path)), wide, True).master_weights  # FSDP, 2 ranks


def test_what_the_other_models_keep_is_taken_off_before_choosing():
    from train.models.memory_plan import auto_settings, count_parameters, resident_bytes

    config, free = preset_config("qwen2.5-0.5b"), 20 * GIB
    params, _ = count_parameters(config)
    assert resident_bytes(config, trainable=False) == 4 * params  # a frozen fp32 reference
    assert resident_bytes(config, trainable=True, shards=4) == 16 * params // 4  # a critic sharded over 4 ranks
    alone = auto_settings(None, None, None, config=config, device_type="cuda", free_bytes=free)
    with_critic = auto_settings(None, None, None, config=config, device_type="cuda", free_bytes=free,
                                reserved_bytes=resident_bytes(config, trainable=True))
    assert with_critic.max_length_per_device < alone.max_length_per_device
    assert _fits(config, with_critic.max_length_per_device, head=True, ckpt=True,
                 free=free - resident_bytes(config, trainable=True))
    assert "once the other models take" in with_critic.note


def test_the_trainer_leaves_room_for_the_reference_and_the_critic(tmp_path):
    """reference_folders and resident_elsewhere, which the trainer uses both for the reserve it hands the actor and
    for the models it builds: a KL reference keeps 4 bytes per parameter (2 in a bf16 run: a frozen model holds
    bf16 weights), a critic 16, a LoRA actor's own base nothing (the reference is the actor with its adapters
    off)."""
    from train.models.memory_plan import count_parameters, load_config
    from train.trainer.config import ModelPaths, has_reference_slot
    from train.trainer.grpo import reference_folders, resident_elsewhere

    stub = str(ROOT / "stub" / "model")
    params, _ = count_parameters(load_config(stub))
    paths = ModelPaths(actor=stub, tokenizer=stub, reference=stub, critic=stub, rollout=stub, rollout_tokenizer=stub)

    def held(overrides: dict, shards: int = 1) -> int:  # as the trainer asks, from the run's config
        cfg = run_config(overrides)
        frozen = reference_folders(paths, [], reference_slot=has_reference_slot(cfg), lora=cfg.actor.lora.rank > 0)
        critic = paths.critic if cfg.adv.estimator == "gae" else None
        return resident_elsewhere(frozen, critic, lambda role: shards, cfg.actor.dtype)

    assert held({}) == 0  # GRPO without KL: nothing else
    assert held({"actor.kl.coef": 0.1}) == 4 * params
    assert held({"actor.kl.coef": 0.1, "actor.dtype": "bfloat16"}) == 2 * params
    assert held({"actor.kl.coef": 0.1, "actor.lora.rank": 8}) == 0
    critic_params, _ = count_parameters(load_config(stub), value_head=True)  # no LM head: a value head
    assert held({"actor.kl.coef": 0.1, "adv.estimator": "gae"}, shards=2) == (4 * params + 16 * critic_params) // 2
    teachers = ModelPaths(**{**vars(paths), "teachers": {"math": stub, "code": stub}})
    assert reference_folders(teachers, [stub, stub], reference_slot=True, lora=True) == [stub, stub]


def test_offloaded_moments_leave_one_bucket_on_the_device_during_the_step():
    """actor.offload_optimizer: the step runs a bucket of parameters at a time (optim.HostMoments), so the update
    needs the weights and gradients plus one bucket of moments at the step, not all of them; offload_model: none."""
    from train.models.memory_plan import MOMENT_BUCKET_BYTES, update_need

    config = preset_config("qwen3-4b")
    p = plan(config, seq=1024, lora_rank=0, checkpointing=True)
    kw = dict(fused_head=True, checkpointing=True)
    assert update_need(config, 1024, **kw) == pytest.approx(p.update_peak * 1.1)
    backward = p.weights + p.gradients + p.activations + p.unshard
    step = p.weights + p.gradients + MOMENT_BUCKET_BYTES
    assert update_need(config, 1024, offload_optimizer=True, **kw) == pytest.approx(max(backward, step) * 1.1)
    # here the backward is the peak either way: offloading takes all of the moments (32 GB at 4B) off it
    assert update_need(config, 1024, **kw) - update_need(config, 1024, offload_optimizer=True, **kw) == \
        pytest.approx(p.optimizer * 1.1)
    assert update_need(config, 1024, offload_model=True, offload_optimizer=True, **kw) < 0.1 * p.update_peak
    # the command plans it too: no moments on the GPU between steps, one bucket in the step
    at_16k = plan(config, seq=16384, offload_optimizer=True)
    assert at_16k.optimizer == 0 and at_16k.optimizer_temporary == MOMENT_BUCKET_BYTES
    assert at_16k.update_peak == plan(config, seq=16384).update_peak - 8 * at_16k.params  # (the backward's peak)
    assert at_16k.rollout_peak == plan(config, seq=16384).rollout_peak - 8 * at_16k.params


def test_the_command_plans_offloaded_moments(capsys):
    assert main(["--model", "qwen3-8b", "--seq", "16384", "--offload-optimizer"]) == 0
    out = capsys.readouterr().out
    assert "AdamW moments 0.0, step temporary 1.0" in out and "141 GB (H200) yes" in out
