"""Activation checkpointing by micro-batch length (memory_plan.recompute_above, chosen on a GPU where a null
actor.gradient_checkpointing comes out on): packs up to the threshold keep their activations, longer ones
recompute, every rank choosing alike for the same pack, and the update is the same bit for bit either way."""
from __future__ import annotations

import pytest
import torch

from conftest import launch_check as launch

FLAGS = ("--max_tokens", "64", "--clip", "0.05")
THRESHOLD = 56


def test_packs_up_to_the_threshold_skip_the_recompute_and_the_update_is_unchanged(tmp_path):
    """FSDP2 over two ranks with uneven shares (different packs per rank): a pack recomputes exactly when the
    longest pack in its place over the ranks is over the threshold (so both ranks choose alike), the layers'
    checkpoint function runs once per layer for each such pack and never for the others, and gradients, the
    clipped norm and the stepped weights equal both checkpointing every pack and checkpointing none."""
    by_length = launch(2, tmp_path / "by_length.pt", "grads", *FLAGS, "--ac", "--recompute_above", str(THRESHOLD))
    every = launch(2, tmp_path / "every.pt", "grads", *FLAGS, "--ac")
    never = launch(2, tmp_path / "never.pt", "grads", *FLAGS)
    ranks = [torch.load(tmp_path / f"by_length.pt.rank{r}.packs") for r in range(2)]
    longest = [max(pair) for pair in zip(*(r["lengths"] for r in ranks))]
    # a rank's own lengths would choose otherwise for some pack: the agreement is not free
    assert any([length > THRESHOLD for length in r["lengths"]] != [length > THRESHOLD for length in longest]
               for r in ranks)
    assert {length > THRESHOLD for length in longest} == {True, False}  # both kinds of pack are there
    for r in ranks:
        assert r["recompute"] == [length > THRESHOLD for length in longest]
        assert r["layers"] > 0 and r["recomputed_layers"] == r["layers"] * sum(r["recompute"])
    all_packs = torch.load(tmp_path / "every.pt.rank0.packs")
    assert all_packs["recomputed_layers"] == all_packs["layers"] * len(all_packs["lengths"])
    assert torch.load(tmp_path / "never.pt.rank0.packs")["layers"] == 0
    for other in (every, never):
        assert other["norm"] == by_length["norm"] > 0.05
        for part in ("grads", "weights"):
            assert other[part].keys() == by_length[part].keys()
            for name, value in by_length[part].items():
                assert torch.equal(other[part][name], value), (part, name)


@pytest.mark.gpu  # benchmarks/gpu_suite.py's `tests` section runs it
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_on_a_gpu_the_limit_comes_from_free_memory_and_the_update_matches(tmp_path):
    """One GPU in bf16 with fp32 masters: the free memory leaves the threshold as set (the stub's update is a few
    MiB), so packs over it recompute and the others do not, and the gradients and stepped weights agree with
    recomputing every pack (to bf16 rounding: a GPU's backward kernels need not be bit for bit between runs)."""
    flags = (*FLAGS, "--dtype", "bfloat16", "--masters", "true", "--ac")
    by_length = launch(1, tmp_path / "by_length.pt", "grads", *flags, "--recompute_above", str(THRESHOLD))
    every = launch(1, tmp_path / "every.pt", "grads", *flags)
    packs = torch.load(tmp_path / "by_length.pt.rank0.packs")
    assert by_length["masters"] and packs["recompute"] == [n > THRESHOLD for n in packs["lengths"]]
    assert set(packs["recompute"]) == {True, False}
    assert packs["recomputed_layers"] == packs["layers"] * sum(packs["recompute"])
    assert abs(by_length["norm"] - every["norm"]) <= 1e-2 * every["norm"]
    for name, value in every["weights"].items():
        assert torch.allclose(by_length["weights"][name], value, rtol=1e-2, atol=1e-3), name
