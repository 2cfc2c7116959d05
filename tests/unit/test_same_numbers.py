"""benchmarks/same_numbers.py, the refactor check: which keys it ignores and what it reports."""
from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from same_numbers import differences, is_timing  # noqa: E402


def test_timings_are_ignored_and_every_other_value_compared_exactly():
    base = [{"step": 1, "rewards/train": 0.5, "time/step_s": 1.0, "rollout/tokens_per_s": 10.0}]
    assert differences(base, [{"step": 1, "rewards/train": 0.5, "time/step_s": 2.0,
                                "rollout/tokens_per_s": 20.0}]) == []
    diff = differences(base, [{"step": 1, "rewards/train": 0.5000000000000001, "time/step_s": 1.0,
                               "rollout/tokens_per_s": 10.0}])
    assert diff == ["row 0 (step 1): rewards/train = 0.5 in the base, 0.5000000000000001 now"]
    assert is_timing("async/trainer_wait_s") and is_timing("rollout/tokens_per_s") and is_timing("time/eval_s")
    for key in ("actor/loss", "rewards/test", "actor/optimizer_steps", "async/staleness_max", "env/stuck_calls"):
        assert not is_timing(key), key


def test_missing_rows_and_keys_are_differences():
    base = [{"step": 1, "actor/loss": 0.1}, {"step": 2, "actor/loss": 0.2}]
    assert differences(base, base[:1])[0] == "2 rows in the base, 1 now"
    assert differences(base[:1], [{"step": 1}]) == ["row 0 (step 1): key 'actor/loss' only in the base run"]
