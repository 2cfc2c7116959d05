"""Verified weight sync (issue 18 item 8): exact checksums of what the engine holds after each push,
and the probe whose engine and trainer log-probs must agree. The checksum against an independent
numpy reference; the trainer's PolicySync and probe on 2 ranks (FSDP) with a real hf engine that
drops a tensor or drifts (fault injection: the engine's copy routine is replaced)."""
import sys

import pytest
import torch

from conftest import ROOT, run_torchrun, slow
from train.utils.checksum import Checksummer, checksums, tensor_checksum

MASK = (1 << 64) - 1


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def reference_checksum(t: torch.Tensor) -> int:
    """The definition in the checksum module's docstring, in Python integers from the tensor's raw bytes:
    little-endian 32-bit words, zero-padded to blocks of 32 x 32; per block the rows', the columns' and the
    block's sums mod 2**32; then nbytes * 40503 + sum_b [(b + 1000003) * S_b + sum_r (r + 1) R_br
    + 2654435761 * sum_c (c + 1) C_bc] mod 2**64. Written separately from the module."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    total = len(data) * 40503
    data += bytes(-len(data) % 4)
    values = [_signed(int.from_bytes(data[i:i + 4], "little"), 32) for i in range(0, len(data), 4)]
    values += [0] * (-len(values) % 1024)
    for b in range(len(values) // 1024):
        block = values[b * 1024:(b + 1) * 1024]
        rows = [_signed(sum(block[r * 32:(r + 1) * 32]), 32) for r in range(32)]
        cols = [_signed(sum(block[c::32]), 32) for c in range(32)]
        total += (b + 1_000_003) * _signed(sum(block), 32) + sum((r + 1) * x for r, x in enumerate(rows))
        total += 2_654_435_761 * sum((c + 1) * x for c, x in enumerate(cols))
    return _signed(total, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.bool])
@pytest.mark.parametrize("shape", [(37, 20), (37, 19), (19,), (), (3, 1100)],
                         ids=["even-rows", "odd-rows", "1d", "0d", "several-blocks"])
def test_checksum_matches_an_independent_reference(dtype, shape):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 1e3).to(dtype)
    assert int(tensor_checksum(t)) == reference_checksum(t)
    huge = torch.full((4, 600), -1.0e38)  # sums that wrap int32, totals that wrap int64
    assert int(tensor_checksum(huge)) == reference_checksum(huge)


def test_checksums_of_many_tensors_equal_each_ones_alone_however_grouped():
    """The trainer and the engine group tensors differently (what a push streams, what the engine holds):
    a tensor's checksum must not depend on its neighbours or on the group size."""
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(37, 20, generator=g), torch.randn(5, generator=g).bfloat16(), torch.zeros(0),
          torch.ones(3, dtype=torch.bool), torch.randn(2048, 3, generator=g),
          torch.randn(9, generator=g).half()[1:8],  # a view at an odd offset: not whole words
          torch.randn(64, 64, generator=g).t()]  # not contiguous
    alone = [reference_checksum(t) for t in ts]
    for chunk in (1, 100, 10_000, 1 << 30):
        assert checksums(ts, chunk_bytes=chunk).tolist() == alone
    big = [torch.randn(300_000, generator=g), torch.randn(70_001, generator=g)]  # read in place on CPU (>= 256 KB)
    assert checksums(big + ts).tolist() == [reference_checksum(t) for t in big] + alone


def test_a_checksummer_keeps_its_layouts_between_calls_and_stays_exact():
    """What a push runs (PolicySync's and the engine's Checksummer): the same shapes call after call with new
    values, other groups in between that leave their data in the shared staging buffer's padding, a group
    that needs a bigger buffer, and the buffer's memory released between calls. Every checksum equals the
    reference, and a layout seen before is not laid out again."""
    g = torch.Generator().manual_seed(2)
    push = [torch.nn.Parameter(torch.randn(37, 20, generator=g)), torch.randn(5, generator=g).bfloat16(),
            torch.ones(3, dtype=torch.bool), torch.zeros(0), torch.randn(9, generator=g).half()[1:8],
            torch.randn(64, 64, generator=g).t(), torch.randn(300_001, generator=g)]  # the last read in place on CPU
    other = [torch.full((2000,), -1, dtype=torch.int32), torch.randn(3000, generator=g)]  # fills the padding
    bigger = [torch.randn(40_000, generator=g)]  # more staging than `push` needs: a new buffer
    summer = Checksummer(chunk_bytes=1 << 20)  # `push` is two groups: its last tensor does not fit the first
    layouts = []
    plan = summer._plan
    summer._plan = lambda *args: layouts.append(len(args[0])) or plan(*args)
    for round_ in range(3):
        for t in push:
            if t.numel() and t.dtype.is_floating_point:
                t.data.add_(1.0)  # new values, as after an update
        assert summer(push).tolist() == [reference_checksum(t) for t in push]
        assert summer(other).tolist() == [reference_checksum(t) for t in other]
        if round_ == 1:
            assert summer(bigger).tolist() == [reference_checksum(t) for t in bigger]
        summer.release()  # a no-op on the host: its memory is released by hand, as on a device
        for staging in summer._staging.values():
            staging.untyped_storage().resize_(0)
    # Each group laid out once: push's two and other in round 0, bigger in round 1 (a new buffer, which drops
    # the layouts that viewed the old one), push's two and other again in round 2.
    assert layouts == [6, 1, 2, 1, 6, 1, 2]


def test_checksum_sees_one_bit_swapped_rows_and_a_transpose_but_not_the_layout():
    t = torch.randn(8, 8)
    base = int(tensor_checksum(t))
    flipped = t.clone()
    flipped.view(torch.int32)[3, 4] ^= 1  # one mantissa bit
    assert int(tensor_checksum(flipped)) != base
    assert int(tensor_checksum(t[[1, 0, *range(2, 8)]])) != base
    swapped = t.clone().reshape(-1)
    swapped[[5, 6]] = swapped[[6, 5]]  # two neighbouring words
    assert int(tensor_checksum(swapped.reshape(8, 8))) != base
    assert int(tensor_checksum(t.t())) != base
    assert int(tensor_checksum(t.t().contiguous().t())) == base  # the same values, another memory layout
    assert int(tensor_checksum(t.to(torch.bfloat16))) != base  # dtype matters: the engine's dtype is compared
    assert int(tensor_checksum(torch.zeros(4))) != int(tensor_checksum(torch.zeros(5)))  # length matters


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
engine._copy = lambda into, froms: time.sleep(60)  # fault injection: the engine never finishes a copy
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
