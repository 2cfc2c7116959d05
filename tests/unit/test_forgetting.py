"""train/trainer/forgetting.py: the first evaluation sets the baselines; a watched metric that falls more than
max_drop below its baseline is forgetting; the last passing evaluation is remembered and survives a resume."""
from __future__ import annotations

from train.trainer.forgetting import ForgettingGate


def test_a_drop_past_max_drop_is_forgetting_and_a_smaller_one_is_not():
    gate = ForgettingGate(["rewards/test/addition"], max_drop=0.05, action="warn")
    assert gate.judge(0, {"rewards/test": 0.2, "rewards/test/addition": 0.80}) is None  # the baseline
    assert gate.judge(10, {"rewards/test/addition": 0.76}) is None and gate.passed == 10
    why = gate.judge(20, {"rewards/test/addition": 0.70})
    assert why.startswith("rewards/test/addition 0.700 is 0.100 below its first evaluation's 0.800")
    assert "trainer.forgetting.max_drop=0.05" in why and gate.passed == 10
    assert gate.judge(30, {"rewards/test": 0.9}) is None  # an unwatched metric changes nothing


def test_the_gate_resumes_with_its_baselines():
    gate = ForgettingGate(["rewards/test"], max_drop=0.0, action="rollback")
    gate.judge(0, {"rewards/test": 0.5})
    resumed = ForgettingGate(["rewards/test"], max_drop=0.0, action="rollback")
    resumed.load_state_dict(gate.state_dict())
    assert resumed.judge(5, {"rewards/test": 0.49}) is not None and resumed.passed == 0
