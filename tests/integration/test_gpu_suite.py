"""`benchmarks/gpu_suite.py --tiny`: every section of the GPU suite runs on CPU with tiny shapes, so
the one command a GPU machine runs never rots. The numbers are CPU numbers and only checked for sense."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

SECTIONS = ("tests", "demo", "decode", "mfu", "push", "step")


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
    # the static-cache path at every batch (on CPU without graphs), then the dynamic one at the largest
    decode = s["decode"]["batches"]
    assert [(r["path"], r["batch"]) for r in decode] == (
        [("static", b) for b in result["shapes"]["decode_batches"]] + [("dynamic", result["shapes"]["decode_batches"][-1])])
    for row in decode:
        assert row["tokens"] == row["batch"] * row["new_tokens"]  # ignore_eos: every row runs to the end
        assert 0 < row["fraction_of_bound"] and row["tokens_per_s"] > 0 and row["cuda_graphs"] == 0
    for row in s["mfu"]["micro_batches"]:
        assert 0 < row["mfu"] < 1.5 and row["seconds"] > 0
    # the plain LM head at each size, then the fused one
    assert [(m["lm_head"], m["tokens"]) for m in s["mfu"]["micro_batches"]] == [
        (head, t) for head in ("plain", "fused") for t in result["shapes"]["mfu_tokens"]]
    assert s["push"]["s_per_billion"] > 0 and s["push"]["s_per_billion_unverified"] > 0 and s["push"]["params"] > 0
    for name in ("decode_profile.txt", f"mfu_profile_{max(result['shapes']['mfu_tokens'])}_fused.txt",
                 "push_profile_verify_True.txt"):
        assert "Self CPU" in (tmp_path / name).read_text()  # the profiles the GPU run is read by
    assert s["step"]["steps"] == 3 and s["step"]["time/step_s"] > 0 and "time/rollout_s" in s["step"]
    table = (tmp_path / "gpu_suite.md").read_text()
    assert result["device"]["device"] in table and "FAILED" not in table
