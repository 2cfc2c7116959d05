"""train/trainer/health.py: each rule fires on a planted anomaly after `patience` steps, stays silent on a
healthy run's metrics, and resumes from its state; an escalated alarm is a governor panic."""
from __future__ import annotations

import math

import pytest

from train.trainer.governor import Governor
from train.trainer.health import HealthDetector


def healthy(step: int) -> dict[str, float]:
    """A run that learns: ratios near 1, a little clipping, entropy falling slowly, a steady gradient norm, answers
    getting shorter while the reward rises (the stub demo's shape)."""
    return {"actor/ratio_max": 1.3 + 0.1 * math.sin(step), "actor/ratio_min": 0.75, "actor/clip_fraction": 0.02,
            "actor/entropy": 2.0 * math.exp(-step / 100), "actor/grad_norm": 1.0 + 0.3 * math.sin(step / 3),
            "critic/explained_variance": 0.4, "response_length/train": 20.0 - step / 20,
            "rewards/train": 0.2 + step / 400}


def run(detector: HealthDetector, steps: range, plant=lambda step, m: m) -> list[tuple[int, str, str]]:
    out = []
    for step in steps:
        for alarm in detector.observe(plant(step, healthy(step))):
            out.append((step, alarm.rule, alarm.message))
    return out


def test_a_healthy_run_raises_no_alarm():
    assert run(HealthDetector(), range(200)) == []


@pytest.mark.parametrize("rule,plant,expect", [
    ("ratio", lambda s, m: {**m, "actor/ratio_max": 40.0} if s >= 50 else m, "actor/ratio_max 40 > 20"),
    ("ratio", lambda s, m: {**m, "actor/ratio_min": 0.001} if s >= 50 else m, "actor/ratio_min 0.001 < 0.01"),
    ("clip", lambda s, m: {**m, "actor/clip_fraction": 0.6} if s >= 50 else m, "actor/clip_fraction 0.6 > 0.3"),
    ("entropy", lambda s, m: {**m, "actor/entropy": 1e-5} if s >= 50 else m, "actor/entropy 1e-05 < 0.001"),
    ("critic", lambda s, m: {**m, "critic/explained_variance": -3.0} if s >= 50 else m,
     "critic/explained_variance -3 < -1"),
    ("grad_norm", lambda s, m: {**m, "actor/grad_norm": 50.0} if s >= 50 else m, "actor/grad_norm 50 > 10 x"),
    ("length", lambda s, m: {**m, "response_length/train": 20.0 * 1.1 ** (s - 40), "rewards/train": 0.3}
     if s >= 40 else m, "response_length/train"),
])
def test_each_rule_alarms_on_its_planted_anomaly_after_patience_steps(rule, plant, expect):
    alarms = run(HealthDetector(patience=3), range(80), plant)
    assert alarms, f"{rule} never alarmed"
    step, name, message = alarms[0]
    assert name == rule and expect in message and "for 3 steps" in message
    if rule != "length":  # the length rule needs its window to see the growth
        assert step == 52  # planted at step 50, held 3 steps
    assert {a[1] for a in alarms} == {rule}  # no other rule fires


def test_an_alarm_repeats_every_patience_steps_while_the_rule_holds_and_stops_after():
    alarms = run(HealthDetector(patience=2), range(30), lambda s, m: {**m, "actor/clip_fraction": 0.9}
                 if 10 <= s < 17 else m)
    assert [a[0] for a in alarms] == [11, 13, 15]


def test_a_resumed_detector_continues_where_it_stopped():
    plant = lambda s, m: {**m, "actor/grad_norm": 50.0} if s >= 30 else m  # noqa: E731
    whole = run(HealthDetector(), range(60), plant)
    first = HealthDetector()
    run(first, range(31), plant)
    resumed = HealthDetector()
    resumed.load_state_dict(first.state_dict())
    assert [a for a in whole if a[0] >= 31] == run(resumed, range(31, 60), plant)


def test_an_escalated_alarm_is_a_governor_panic():
    g = Governor(["actor/loss"], window=10, k_sigma=6, min_history=3, min_panics=2, rel_std_floor=0.25)
    assert g.observe({"actor/loss": 1.0}).action == "accept"
    held = g.observe({"actor/loss": 1.0}, ["health: clip: actor/clip_fraction 0.9 > 0.3 for 3 steps"])
    assert held.action == "hold" and "health: clip" in held.reason
    assert g.observe({"actor/loss": 1.0}, ["health: clip: again"]).action == "rollback"
