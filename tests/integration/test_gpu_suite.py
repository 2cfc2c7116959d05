"""`benchmarks/gpu_suite.py --tiny`: every section of the GPU suite runs on CPU with tiny shapes, so
the one command a GPU machine runs never rots. The numbers are CPU numbers and only checked for sense."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

SECTIONS = ("tests", "demo", "decode", "decode_layers", "mfu", "mfu_compiled", "push", "step", "trl", "bigmodel", "moe", "vlm",
            "ring", "head")


@pytest.mark.slow
def test_gpu_suite_tiny_runs_every_section(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--tiny", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    s = result["sections"]
    assert list(s) == list(SECTIONS) and not [n for n in s if "error" in s[n]], s
    assert result["tiny"] and result["device"]["cuda"] is False
    # the gpu-marked tests were found and, without CUDA, skipped
    assert s["tests"]["files"] and s["tests"]["skipped"] >= 2 and s["tests"]["passed"] == 0
    assert s["demo"]["test_reward"] and all(0.0 <= r <= 1.0 for _, r in s["demo"]["test_reward"])
    # the static-cache path at every batch (on CPU without graphs), the dynamic one at the largest, then
    # the static path with compiled norm and MLP modules (rollout.compile_decode; inductor's C++ on CPU), and last
    # the peer: transformers' generate with its static cache on the largest batch; then (decode_layers) compiled
    # decoder layers (rollout.compile_decode_scope=layers)
    decode = s["decode"]["batches"]
    batches = result["shapes"]["decode_batches"]
    peer = "transformers generate (static cache)"
    assert [(r["path"], r["batch"]) for r in decode] == (
        [("static", b) for b in batches] + [("dynamic", batches[-1])] + [("static+compiled", b) for b in batches]
        + [(peer, batches[-1])])
    layers = s["decode_layers"]["batches"]  # its own section
    assert [(r["path"], r["batch"]) for r in layers] == [("static+compiled layers", b) for b in batches]
    for row in decode + layers:
        assert row["tokens"] == row["batch"] * row["new_tokens"]  # ignore_eos: every row runs to the end
        assert 0 < row["fraction_of_bound"] and row["tokens_per_s"] > 0
        if row["path"] != peer:
            assert row["cuda_graphs"] == 0
            assert (row["compiled_modules"] > 0) == row["path"].startswith("static+compiled")
            assert row["compile_error"] is None
    # TRL's GRPOTrainer against ours on this device (requirements-bench.txt); without trl, a note and no failure
    trl = s["trl"]
    if "skipped" in trl:
        assert "trl is not installed" in trl["skipped"]
    else:
        assert trl["ours"]["step_s_mean"] > 0 and trl["trl"]["step_s_mean"] > 0 and trl["ours_over_trl_samples_per_s"] > 0
    # the big-model cases at toy sizes: LoRA trains its adapters only; the full model's push is timed
    big = {c["case"]: c for c in s["bigmodel"]["cases"]}
    assert list(big) == ["llama3.1-8b-lora32", "qwen3-4b-full", "llama3.1-8b-lora32-20k"]
    lora, full = big["llama3.1-8b-lora32"], big["qwen3-4b-full"]
    assert 0 < lora["trainable_params"] < lora["params"] and full["trainable_params"] == full["params"]
    assert full["push_s_per_billion"] > 0 and "push_s_per_billion" not in lora
    assert lora["engine_borrows_base"] and not full["engine_borrows_base"]  # rollout.share_actor_base
    for case in big.values():
        assert case["update_s"] > 0 and case["rollout_s"] > 0 and case["update_peak_gib"] is None  # no CUDA
        assert case["engine_host_gib"] == 0  # a CPU engine's sleep keeps its weights where they are
    for row in s["mfu"]["micro_batches"]:
        assert 0 < row["mfu"] < 1.5 and row["seconds"] > 0
    # the plain LM head at each size, then the fused one
    longest = max(result["shapes"]["mfu_tokens"])
    assert [(m["lm_head"], m["tokens"], m["compiled"]) for m in s["mfu"]["micro_batches"]] == [
        (head, t, False) for head in ("plain", "fused") for t in result["shapes"]["mfu_tokens"]]
    # the compiled actor (actor.compile) at the longest length, in its own section
    assert [(m["lm_head"], m["tokens"], m["compiled"]) for m in s["mfu_compiled"]["micro_batches"]] == [
        ("plain", longest, True), ("fused", longest, True)]
    # (the first update's seconds include compiling; with inductor's cache warm they may not exceed the timed one's)
    assert all(0 < m["mfu"] < 1.5 and m["warmup_s"] > 0 for m in s["mfu_compiled"]["micro_batches"])
    assert s["push"]["s_per_billion"] > 0 and s["push"]["s_per_billion_unverified"] > 0 and s["push"]["params"] > 0
    for name in ("decode_profile.txt", "decode_profile_compiled_layers.txt", f"mfu_profile_{longest}_fused.txt", f"mfu_profile_{longest}_compiled.txt",
                 "push_profile_verify_True.txt"):
        assert "Self CPU" in (tmp_path / name).read_text()  # the profiles the GPU run is read by
    assert s["step"]["steps"] == 3 and s["step"]["time/step_s"] > 0 and "time/rollout_s" in s["step"]
    # the defaults, then the engine told to sleep through every update (on CPU null calls the no-op sleep too),
    # then the stub config's packs
    assert s["step"]["sleep_true"]["steps"] == 3 and s["step"]["sleep_true"]["engine/slept"] == 1.0
    assert s["step"]["packs_8192"]["steps"] == 3 and s["step"]["packs_8192"]["time/update_s"] > 0
    moe = s["moe"]  # a mixture of experts, with router replay and the balance loss, then without replay
    assert moe["replay"]["steps"] == 3 and moe["no_replay"]["steps"] == 3
    assert moe["replay"]["actor/router_aux_loss"] > 0 and "actor/router_aux_loss" not in moe["no_replay"]
    assert moe["replay"]["actor/sampler_kl"] < 1e-4  # fp32 on both sides on CPU
    vlm = s["vlm"]  # a vision-language model trains on pictures (3 steps); fp32 on both sides on CPU
    assert vlm["steps"] == 3 and vlm["image_tokens"] == 4 and vlm["actor/sampler_kl"] < 1e-4
    [ring] = s["ring"]["rows"]  # the ring's tiles on this device = SDPA over the same row
    assert ring["kernel"] == "FlashCPUKernel" and ring["max_abs_diff"] < 1e-5 and ring["ring_s"] > 0
    # the log-prob heads, plain and fused, without and with an entropy bonus: what they held against the plan
    heads = s["head"]["rows"]
    assert [(r["head"], r["entropy_bonus"]) for r in heads] == [(h, b) for h in ("plain", "fused") for b in (False, True)]
    assert all(0.9 * r["planned_bytes"] <= r["peak_bytes"] <= 1.05 * r["planned_bytes"] and r["seconds"] > 0
               for r in heads), heads  # (at tiny shapes the per-token buffers the plan leaves out weigh more)
    table = (tmp_path / "gpu_suite.md").read_text()
    assert result["device"]["device"] in table and "FAILED" not in table


@pytest.mark.slow
def test_gpu_suite_tiny_runs_the_case_only_named_the_big_model_with_its_moments_offloaded(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--tiny", "--out", str(tmp_path), "--only",
                           "bigmodel", "--big-cases", "qwen3-4b-full-offload"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    [case] = json.loads((tmp_path / "gpu_suite.json").read_text())["sections"]["bigmodel"]["cases"]
    assert case["case"] == "qwen3-4b-full-offload" and case["offload_optimizer"] and case["update_s"] > 0
    # AdamW's two float32 moments of every parameter wait on the host (each tensor rounded up to 512 bytes)
    assert 8 * case["trainable_params"] <= case["host_moments_gib"] * 2**30 <= 8 * case["trainable_params"] + 2**20
    assert case["estimate_update_gib"] > 0
