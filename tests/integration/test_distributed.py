"""1 rank vs 2 and 4 ranks in every parallel layout (torchrun, gloo): the same gradients, global clip
norm and updated weights for the same rollout data, whatever the split, packing (prompts shared or
not) and layout."""

import pytest
import torch

from conftest import assert_same_update, launch_check as launch, slow, tiny_model


# all_token_mean with the uneven split is test_actor_layouts_match_one_process[fsdp2]
# slow: the layout tests below run all_token_mean on the same path; the aggregations' own normalisers are
# tests/unit/test_algorithms.py's, and the sequence-level losses across shards test_sequence_level_loss_...
@pytest.mark.parametrize("agg,split", [slow("seq_mean_token_mean", "uneven"), slow("seq_mean_token_sum_norm", "all_on_rank0")])
def test_one_and_two_ranks_give_the_same_gradients(tmp_path, single_process, agg, split):
    # A small clip norm makes clipping active, so the *global* norm is checked too.
    one = single_process("grads", "--agg", agg)
    two = launch(2, tmp_path / "two.pt", "grads", "--agg", agg, "--split", split, "--max_tokens", "64",
                 "--clip", "0.05")
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        # float32 sums in a different order: agree to ~1e-6 of the tensor's scale.
        scale = float(g.abs().max())
        torch.testing.assert_close(two["grads"][name], g, rtol=0, atol=1e-5 * scale, msg=name)
    assert one["norm"] > 0.05  # clipping really happened
    assert abs(one["norm"] - two["norm"]) < 1e-5 * one["norm"]
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-5, msg=name)  # Adam: ~1% of a step


def test_sampler_and_trainer_logprobs_agree_and_push_updates_engine(tmp_path):
    out = launch(1, tmp_path / "match.pt", "match")
    assert out["max_logprob_diff"] < 1e-4
    assert out["push_diff"] == 0.0
    assert out["changed"]  # the engine samples from the new weights


@pytest.mark.slow
def test_critic_one_and_two_ranks_give_the_same_gradients(tmp_path, single_process):
    """The clipped value loss is normalised by the global action-token count, x world size; all
    samples on rank 0 (the uneven split is covered by test_critic_layouts_match_one_process)."""
    split = "all_on_rank0"
    one = single_process("critic_grads", "--grouped")
    two = launch(2, tmp_path / "two.pt", "critic_grads", "--split", split, "--max_tokens", "64", "--clip", "0.05",
                 "--grouped", "--share")
    assert one["grads"].keys() == two["grads"].keys()
    assert float(one["grads"]["model.layers.0.mlp.up_proj.weight"].abs().max()) > 0  # the backbone learns too
    for name, g in one["grads"].items():
        scale = float(g.abs().max())
        torch.testing.assert_close(two["grads"][name], g, rtol=0, atol=1e-5 * scale, msg=name)
    assert one["norm"] > 0.05 and abs(one["norm"] - two["norm"]) < 1e-5 * one["norm"]
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_reference_actor_shares_nothing_with_the_policy(tmp_path):
    out = launch(2, tmp_path / "ref.pt", "reference")
    assert out["shared"] == 0 and not out["ref_requires_grad"]
    assert out["ref_moved"] == 0.0 and out["policy_moved"] > 0
    assert out["kls"][0] == pytest.approx(0.0, abs=1e-6)  # the same weights at first: KL 0
    assert out["kls"][-1] > 1e-4  # then the policy drifts away from the frozen reference


def test_routed_teachers_score_only_their_samples_on_two_ranks(tmp_path):
    """distill.teachers on 2 ranks (FSDP2): every routed sample gets exactly its teacher's log-probs, an unrouted
    one zeros, though only one rank holds the second teacher's one sample (the other runs a padding forward)."""
    out = launch(2, tmp_path / "teachers.pt", "teachers")
    assert out["per_route"] == [3.0, 6.0, 1.0]  # none, first, second (samples counted once per dp group)
    assert out["teachers_apart"] > 1e-3  # the two teachers really differ
    assert out["diff"] < 1e-5 and out["untaught"] == 0.0


# (name, processes, layout flags): dp=2 is pure replication (HSDP with shards of 1), fsdp=2 shards.
LAYOUTS = {
    "dp2": (2, ["--ddp", "2"]),
    "fsdp2": (2, []),
    "tp2": (2, ["--tp", "2"]),
    "sp2": (2, ["--sp", "2"]),
    "fsdp2_tp2": (4, ["--tp", "2"]),
    "ddp2_tp2": (4, ["--ddp", "2", "--tp", "2"]),
    # sp x tp with activation checkpointing (its recomputation re-runs the collectives): one run
    # covers both, so the suite pays for one 4-process launch, not two
    "sp2_tp2_checkpointed": (4, ["--sp", "2", "--tp", "2", "--ac"]),
    # CPU offload of parameters (FSDP2 CPUOffloadPolicy) and optimizer state: on a CPU-only machine
    # the data does not move, but the code path (and its numbers) are the same as on GPU
    "fsdp2_offload": (2, ["--offload"]),
}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: one process, unsharded, big micro-batches; computed once per mode."""
    cache: dict = {}

    def get(mode: str, *extra: str) -> dict:
        key = (mode, extra)
        if key not in cache:
            out = tmp_path_factory.mktemp("one") / "one.pt"
            cache[key] = launch(1, out, mode, "--max_tokens", "200", "--clip", "0.05", *extra)
        return cache[key]
    return get


# The layout runs take samples in GRPO groups that share a prompt and pack them with
# actor.share_prompt (each group's prompt laid out once, split where a pack's budget ends; lone
# samples packed as they are); the reference is one process, unshared, on the same samples.
SHARED = ("--grouped", "--share")


# Each layout with -m slow: in the default suite, test_qwen_families_under_tensor_and_sequence_parallel's
# 4-rank run (fsdp 2 over the sp ranks x tp 2 x sp 2, shared prompts) covers fsdp x tp and sp x tp.
@pytest.mark.parametrize("layout", [slow(layout) for layout in LAYOUTS])
def test_actor_layouts_match_one_process(tmp_path, single_process, layout):
    nproc, flags = LAYOUTS[layout]
    other = launch(nproc, tmp_path / "x.pt", "grads", "--max_tokens", "64", "--clip", "0.05", *SHARED, *flags)
    assert_same_update(single_process("grads", "--grouped"), other)


@pytest.mark.parametrize("layout", ["sp2", slow("tp2")])
def test_sequence_level_loss_and_entropy_bonus_across_shards(tmp_path, single_process, layout):
    """GSPO's sequence ratio and per-sequence means need every token of a sequence: under sp the
    tokens live on different ranks, under tp the entropy comes from vocabulary slices."""
    extra = ("--loss", "gspo", "--agg", "seq_mean_token_mean", "--entropy", "0.01", "--grouped")
    nproc, flags = LAYOUTS[layout]
    other = launch(nproc, tmp_path / "x.pt", "grads", "--max_tokens", "64", "--clip", "0.05", "--share", *flags,
                   *extra)
    assert_same_update(single_process("grads", *extra), other, weight_atol=3e-5)


# slow (~1-2 min each of inductor C++ builds): tests/unit/test_compile_layers.py checks the compiled layers by default.
# tp_size > 1 is refused (its embeddings' gradients came out wrong compiled: test_parallel_layout.py).
@pytest.mark.parametrize("nproc,flags", [slow(1, [], id="one-process"), slow(2, ["--ac"], id="fsdp2-checkpointing"),
                                         slow(2, ["--sp", "2", *SHARED], id="sp2-shared"),
                                         slow(2, ["--cp", "2", *SHARED], id="cp2-shared"),
                                         slow(1, ["--lora", "8"], id="lora")])
def test_compiled_layers_give_the_eager_update(tmp_path, single_process, nproc, flags):
    """actor.compile: each decoder layer through torch.compile (inductor's C++ backend here), micro-batches of
    several lengths (a recompile, then dynamic shapes), against the eager single-process update."""
    other = launch(nproc, tmp_path / "x.pt", "grads", "--max_tokens", "64", "--clip", "0.05", "--compile", *flags)
    assert other["compiled_modules"] == 4 and other["graphs"] > 0  # the stub's decoder layers, really compiled
    reference = [f for f in flags if f in ("--grouped", "--lora", "8")]  # the same samples (and adapters), eager
    assert_same_update(single_process("grads", *reference), other, all_learn="--lora" not in flags)


# All in the slow set (suite time): the critic shares the Trainable update loop and the backbone's
# parallel plans with the actor, whose layout cases run by default
@pytest.mark.parametrize("layout", [slow("dp2"), slow("fsdp2"), slow("tp2"), slow("sp2"), slow("fsdp2_tp2")])
def test_critic_layouts_match_one_process(tmp_path, single_process, layout):
    nproc, flags = LAYOUTS[layout]
    other = launch(nproc, tmp_path / "x.pt", "critic_grads", "--max_tokens", "64", "--clip", "0.05", *SHARED,
                   *flags)
    assert_same_update(single_process("critic_grads", "--grouped"), other)


@pytest.mark.parametrize("family", [slow("qwen2"), "qwen3"])
def test_qwen_families_under_tensor_and_sequence_parallel(tmp_path_factory, tmp_path, family):
    """The TP plan's module names and the Ulysses attention hold for Qwen2 (biases) and Qwen3
    (q/k norms over local heads): tp=2 x sp=2 (one 4-rank run covers both; FSDP shards over the 2 sp
    ranks), GRPO groups packed with their prompts shared, gives the 1-process gradients and weights."""
    model = tiny_model(tmp_path_factory, family)
    one = launch(1, tmp_path / "one.pt", "grads", "--max_tokens", "200", "--clip", "0.05", "--model", model,
                 "--grouped")
    other = launch(4, tmp_path / "x.pt", "grads", "--max_tokens", "64", "--clip", "0.05", "--model", model,
                   "--tp", "2", "--sp", "2", *SHARED)
    assert_same_update(one, other)


@pytest.mark.slow
def test_advantages_are_the_same_on_one_and_two_ranks(tmp_path):
    """Every estimator through the step batch: groups split over dp groups, statistics from
    all-reduced sums, the same per-token advantages (and GAE returns) as one process."""
    one = launch(1, tmp_path / "one.pt", "advantages")
    two = launch(2, tmp_path / "two.pt", "advantages")
    assert two["split_groups"]  # the dispatch really put a group's samples on both dp groups
    for name, case in one["cases"].items():
        other = two["cases"][name]
        assert sorted(case["per_sample"]) == sorted(other["per_sample"]) == list(range(16))
        for i, (adv, ret) in case["per_sample"].items():
            adv2, ret2 = other["per_sample"][i]
            assert adv.abs().max() > 0 or name == "grpo", (name, i)
            torch.testing.assert_close(adv2, adv, rtol=1e-5, atol=1e-6, msg=f"{name} sample {i}")
            if ret is not None:
                torch.testing.assert_close(ret2, ret, rtol=1e-5, atol=1e-6)
        for key, value in case["metrics"].items():
            assert other["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (name, key)


def test_one_step_issues_a_bounded_number_of_collectives(tmp_path):
    """PPO with a critic, KL to a reference, 2 epochs x 2 mini-batches on 2 ranks: the trainer's own
    collectives in one step (FSDP's and DTensor's aside). The step batch is dispatched once (two
    all-gathers of its index, two all-to-alls); the earlier design all-gathered the batch ~75 times."""
    out = launch(2, tmp_path / "count.pt", "collectives")
    counts = out["counts"]
    by_kind = {}
    for key, n in counts.items():
        kind = key.split(" ")[0]
        by_kind[kind] = by_kind.get(kind, 0) + n
    assert by_kind.get("all_to_all_single", 0) == 2  # ids + masks, log-probs: each sample to its dp group
    flat_gathers = by_kind.get("all_gather_into_tensor", 0) + by_kind.get("all_gather_single", 0)  # 2.11 / 2.13 name
    assert flat_gathers <= 2 + 2 + 1  # the index (2), the weight push (1 per bucket), the pass rates (1)
    assert "all_gather" not in by_kind and "all_gather_object" not in by_kind  # no all-rank batch copies
    # 22 before issue 18/19's per-step checks: the weight-push verification flag (1 all-reduce), the
    # actor's weight norm before/after the update (1) and the curriculum's pass rates (1 all-gather of
    # two floats per group). None of them grows with the model, the batch or the ranks.
    # The gradient clip's norm: one all-reduce per optimizer step (4 actor + 4 critic), on each rank's local
    # shards (train/parallel/shard_norms.py); DTensor issued it inside torch before 2026-11-28.
    clip = sum(n for key, n in counts.items() if "sum_over_mesh" in key)
    assert clip == out["metrics"]["actor/optimizer_steps"] + out["metrics"]["critic/optimizer_steps"] == 8, counts
    assert out["total"] - clip <= 25, counts
    assert out["metrics"]["critic/value_loss"] > 0 and out["metrics"]["actor/optimizer_steps"] == 4


@pytest.mark.parametrize("name,nproc,flags,bucketed", [slow("one", 1, [], False), slow("fsdp2", 2, [], True),
                                                        ("fsdp3", 3, [], True),
                                                        slow("ddp2_fsdp2", 4, ["--ddp", "2"], True),
                                                        ("tp2", 2, ["--tp", "2"], None)])
def test_weight_push_gathers_full_tensors_in_flat_buckets(tmp_path, name, nproc, flags, bucketed):
    """The push's gather equals DTensor.full_tensor() for every weight (fp32, and cast to bf16 before it
    travels), each tied storage once; FSDP/HSDP shards travel in one all-gather per bucket of at most
    --bucket_kb of full tensors; one process gathers nothing (its bf16 casts go a bucket at a time, one
    multi-tensor copy each); under TP, dim-0 shards are bucketed and the others fall back to full_tensor().
    Over 3 ranks every dimension of the stub (128, 352, 512) shards unevenly: the last rank holds fewer rows,
    and the padding must not show."""
    out = launch(nproc, tmp_path / "push.pt", "push", "--bucket_kb", "256", *flags)
    for dtype, r in out["result"].items():
        assert sorted(r["names"]) == sorted(out["expected_names"])  # every weight, each storage once
        assert r["max_err"] == 0.0, dtype  # bit-exact (the bf16 cast happens before the gather: the same bits)
        assert r["dtypes"] == (["torch.float32"] if dtype == "None" else ["torch.bfloat16"])
        if bucketed:
            floor = out["full_bytes"] / (256 * 1024) / (1 if dtype == "None" else 2)
            # greedy filling: two neighbouring buckets hold more than one bucket's worth, so at most
            # 2 x bytes / bucket + 1 gathers, whatever the number of tensors
            assert floor <= r["gathers"] <= 2 * floor + 1, (dtype, r["gathers"], floor)
            assert r["gathers"] < len(out["expected_names"]) / 2
        elif bucketed is False:
            assert r["gathers"] == 0
    assert "lm_head.weight" not in out["expected_names"]  # tied to the embeddings: pushed once



FSDP_UNITS = 5  # the stub's 4 decoder layers and the root


def test_one_gpu_in_bf16_reduces_gradients_once_per_mini_batch_with_the_same_update(tmp_path):
    """One rank with actor.dtype=bfloat16 runs under FSDP2 (bf16 compute, fp32 masters): the backwards of a
    mini-batch's packs add into FSDP's unsharded fp32 gradients and are reduced once, after the last pack,
    instead of once per pack, and the update is the same bit for bit."""
    flags = ("--dtype", "bfloat16", "--max_tokens", "64", "--clip", "0.05")
    once = launch(1, tmp_path / "once.pt", "grads", *flags)
    every = launch(1, tmp_path / "every.pt", "grads", *flags, "--reduce_every_pack")
    assert once["defers"] and not every["defers"] and once["packs"] == every["packs"] >= 3
    assert once["reduces"] == FSDP_UNITS and every["reduces"] == FSDP_UNITS * every["packs"]
    assert once["norm"] == every["norm"]
    for part in ("grads", "weights"):
        for name, value in every[part].items():
            assert torch.equal(once[part][name], value), (part, name)


@pytest.mark.parametrize("layout,deferred", [("dp2", True), slow("fsdp2", False)])
def test_replicas_reduce_once_per_mini_batch_and_shards_after_every_pack(tmp_path, single_process, layout, deferred):
    """Over ddp (each rank a whole replica) one all-reduce per mini-batch, not one per pack: traffic per step
    that does not grow with the packs. Sharded over fsdp, every pack's gradients are reduced at once, so a rank
    never holds more than its 1/fsdp share of them. Either way, the update of one process."""
    nproc, flags = LAYOUTS[layout]
    other = launch(nproc, tmp_path / "x.pt", "grads", "--max_tokens", "64", "--clip", "0.05", *SHARED, *flags)
    assert other["defers"] == deferred and other["packs"] >= 2
    assert other["reduces"] == FSDP_UNITS * (1 if deferred else other["packs"])
    assert_same_update(single_process("grads", "--grouped"), other)


def test_clipping_and_the_weight_norm_over_shards_equal_float64_references(tmp_path):
    """optim.clip_grad_norm and Trainable.local_weight_square on 2 ranks, with parameters sharded unevenly (FSDP),
    replicated, replicated over ddp (HSDP), and a Partial gradient (the DTensor fallback): each rank computes on its
    own pieces, one all-reduce makes the global norm; norms and clipped gradients against float64."""
    max_norm = 1.0
    out = launch(2, tmp_path / "norms.pt", "shard_norms", "--clip", str(max_norm))
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(s, generator=g).double() for s in out["shapes"]]
    grads = [torch.randn(s, generator=g).double() for s in out["shapes"]]
    norm = sum(float((x ** 2).sum()) for x in grads) ** 0.5
    weight_norm = sum(float((x ** 2).sum()) for x in weights) ** 0.5
    assert norm > 2 * max_norm  # clipping really happens
    for case in ("fsdp", "hsdp", "partial"):
        assert out[case]["norm"] == pytest.approx(norm, rel=1e-6), case
        assert out[case]["weight_norm"] == pytest.approx(weight_norm, rel=1e-6), case
        for clipped, grad in zip(out[case]["clipped"], grads):
            torch.testing.assert_close(clipped.double(), grad * max_norm / (norm + 1e-6), rtol=1e-6, atol=1e-7)
