"""`python -m train.eval`: a model folder on a dataset with an env module, outside training."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from conftest import ROOT, trainer_env
from train.eval import pass_at_k, summarize


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_some_of_k_drawn_replies_pass(n):
    """Against counting: every k-subset of n replies of which c pass."""
    for c in range(n + 1):
        replies = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(replies, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_summaries_are_per_row_means_overall_and_per_source():
    out = summarize([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], ["a", "a", "b"], [1, 2], 1.0)
    assert out["reward"] == pytest.approx(0.5) and out["pass@1"] == pytest.approx(0.5)
    assert out["pass@2"] == pytest.approx(2 / 3) and out["pass@2/a"] == pytest.approx(0.5)
    assert out["reward/b"] == 1.0 and "reward/a" in out


def test_the_stub_scores_what_its_builder_measured(tmp_path):
    """Greedy on the stub's test set equals the accuracy stub/build_stub.py measured with its own generation
    loop when it built the model (stub/model/warmstart_eval.json), and pass@k comes with sampled replies."""
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "train.eval", "stub/model", "--data", "stub/data/math/test.jsonl", "--env",
           "environments/eq.py", "--max-new-tokens", "12", "--samples", "4", "--k", "1", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    built = json.loads((ROOT / "stub" / "model" / "warmstart_eval.json").read_text())
    assert got["greedy/reward"] == pytest.approx(built["greedy_acc"], abs=1e-6)
    assert got["greedy/rows"] == built["n"] and got["greedy/env_errors"] == 0
    assert 0 < got["sampled/pass@1"] <= got["sampled/pass@4"] <= 1
    assert got["sampled/pass@1"] == pytest.approx(got["sampled/reward"])  # the stub's reward is 0 or 1
