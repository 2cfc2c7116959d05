"""Verified weight sync (issue 18 item 8): exact checksums of what the engine holds after each push,
and the probe whose engine and trainer log-probs must agree. The checksum against an independent
numpy reference; the trainer's PolicySync and probe on 2 ranks (FSDP) with a real hf engine that
drops a tensor or drifts (fault injection: the engine's copy routine is replaced)."""
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, run_torchrun, slow
from train.utils.checksum import tensor_checksum

MASK = (1 << 64) - 1


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def reference_checksum(t: torch.Tensor) -> int:
    """The definition in the checksum module's docstring, in numpy and Python integers: each row's
    32-bit words summed mod 2**32 (or, when a row is not whole words, its elements' bits summed), then
    sum(rows) * 1_000_003 + sum((i + 1) * row_i) mod 2**64. Written separately from the module."""
    raw = t.detach().cpu().contiguous()
    n_rows = raw.shape[0] if raw.dim() > 1 else 1
    data = raw.reshape(-1).view(torch.uint8).numpy().tobytes()
    row_bytes = len(data) // max(n_rows, 1)
    sums = []
    for i in range(n_rows):
        chunk = data[i * row_bytes:(i + 1) * row_bytes]
        if row_bytes % 4 == 0:
            sums.append(_signed(int(np.frombuffer(chunk, dtype=np.int32).astype(object).sum()), 32))
        else:
            width = raw.element_size()
            kind = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[width]
            sums.append(_signed(int(np.frombuffer(chunk, dtype=kind).astype(object).sum()), 64))
    return _signed(sum(sums) * 1_000_003 + sum((i + 1) * s for i, s in enumerate(sums)), 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.bool])
@pytest.mark.parametrize("shape", [(37, 20), (37, 19), (19,), ()], ids=["even-rows", "odd-rows", "1d", "0d"])
def test_checksum_matches_an_independent_reference(dtype, shape):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 1e3).to(dtype)
    assert int(tensor_checksum(t)) == reference_checksum(t)
    huge = torch.full((4, 6), -1.0e38)  # row sums that wrap int32, totals that wrap int64
    assert int(tensor_checksum(huge)) == reference_checksum(huge)


def test_checksum_sees_one_bit_swapped_rows_and_a_transpose_but_not_the_layout():
    t = torch.randn(8, 8)
    base = int(tensor_checksum(t))
    flipped = t.clone()
    flipped.view(torch.int32)[3, 4] ^= 1  # one mantissa bit
    assert int(tensor_checksum(flipped)) != base
    assert int(tensor_checksum(t[[1, 0, *range(2, 8)]])) != base
    assert int(tensor_checksum(t.t())) != base
    assert int(tensor_checksum(t.t().contiguous().t())) == base  # the same values, another memory layout
    assert int(tensor_checksum(t.to(torch.bfloat16))) != base  # dtype matters: the engine's dtype is compared


@pytest.mark.parametrize("layout", [["--ddp", "1"], slow(["--ddp", "2"], id="hsdp"), slow(["--tp", "2"], id="tp2")],
                         ids=["fsdp2", "hsdp", "tp2"])
def test_policy_sync_verifies_pushes_and_the_probe_on_two_ranks(tmp_path, layout):
    out = tmp_path / "sync.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           str(ROOT / "tests" / "dist_checks.py"), "sync", "--out", str(out), "--bucket_kb", "64", *layout]
    proc = run_torchrun(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    r0, r1 = (torch.load(tmp_path / f"sync.rank{r}.pt") for r in (0, 1))
    for r in (r0, r1):  # the actor's weight norm (actor/weight_change) over FSDP shards: each counted once
        assert abs(r["weight_norm"] - r["full_norm"]) < 1e-5 * r["full_norm"]
    assert r0["probe_diff"] < 1e-5 and r0["probe_diff"] == r1["probe_diff"]  # max over ranks, float32 rounding
    # The dropping engine is on rank 1: its message names the step, the bucket and the tensor; rank 0 stops too.
    assert "step 4" in r1["lossy"] and "rank 1" in r1["lossy"] and "down_proj" in r1["lossy"]
    assert "bucket(s) [" in r1["lossy"] and "bucket(s) [0]" not in r1["lossy"]  # 64 KB buckets: not the first
    assert r0["lossy"] is not None and "another rank" in r0["lossy"]
    for r in (r0, r1):  # rank 0's engine drifted after the push: the probe stops both
        assert r["drift"] is not None and "step 6" in r["drift"] and "sync_probe_tol" in r["drift"]


HUNG_PUSH = """
import sys, time
sys.path.insert(0, {root!r})
from transformers import AutoModelForCausalLM
from train.engines.hf import HFEngine
from train.runtime.watchdog import Watchdog
from train.trainer.policy_sync import PolicySync

model = AutoModelForCausalLM.from_pretrained({model!r})
engine = HFEngine.from_pretrained({model!r}, seed=0)
engine._write = lambda target, tensor: time.sleep(60)  # fault injection: the engine never finishes a copy
dog = Watchdog(None, 10.0, 0, {dump!r}, poll_s=0.2)
PolicySync(model, engine, 512, None, {{}}, None, watchdog=dog, push_timeout_s=1.0).push(step=7)
print("push returned")
"""


def test_a_push_past_its_timeout_ends_the_rank_naming_the_step_and_bucket(tmp_path):
    import subprocess

    code = HUNG_PUSH.format(root=str(ROOT), model=str(ROOT / "stub" / "model"), dump=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "push returned" not in proc.stdout
    line = next(l for l in proc.stderr.splitlines() if l.startswith("watchdog:"))
    assert "weight push has run for" in line and "rollout.push_timeout_s" in line
    assert "weight push at step 7, bucket 0 (last tensor sent: " in line
    assert (tmp_path / "watchdog_rank0.txt").exists()
