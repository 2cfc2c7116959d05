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


def test_after_a_forgetting_rollback_the_governor_restores_the_rolled_back_state_not_the_forgotten_one():
    """A forgetting rollback restores the last passing evaluation's weights; a governor rollback right after it must
    restore those weights too, not the forgotten ones its snapshot held from the step before."""
    import math
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from train.engines.hf import HFEngine
    from train.trainer.governor import Governor
    from train.trainer.policy_sync import PolicySync

    stub = str(Path(__file__).resolve().parents[2] / "stub" / "model")
    model = AutoModelForCausalLM.from_pretrained(stub)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    worker = type("Worker", (), {"state_parts": lambda self: {"model": model, "optimizer": optimizer,
                                                              "scheduler": scheduler}})()
    lines: list[str] = []
    log = type("Log", (), {"write": lambda self, line: lines.append(line), "event": lambda self, *a: None})()
    engine = HFEngine.from_pretrained(stub, seed=0)
    governor = Governor(["actor/loss"], window=10, k_sigma=6, min_history=3, min_panics=1, rel_std_floor=0.25)
    sync = PolicySync(model, engine, 64, governor, {"actor": worker}, log,
                      forgetting=ForgettingGate(["rewards/test"], max_drop=0.05, action="rollback"))
    weight = model.model.embed_tokens.weight
    evaluated = weight.detach().clone()
    try:
        assert sync.after_evaluation(0, {"rewards/test": 0.5}) == {"forgetting/alarm": 0.0}
        with torch.no_grad():
            weight.add_(1.0)  # an update that forgets
        assert sync.after_update(1, {"actor/loss": 1.0}, push=True)["governor/panic"] == 0.0  # accepted
        assert sync.after_evaluation(1, {"rewards/test": 0.1})["forgetting/rollback"] == 1.0
        assert torch.equal(weight, evaluated)
        with torch.no_grad():
            weight.add_(2.0)  # the next update blows up
        assert sync.after_update(2, {"actor/loss": math.nan}, push=True)["governor/rollback"] == 1.0
        assert torch.equal(weight, evaluated)  # the state of the rollback, not step 1's forgotten one
    finally:
        engine.close()


def test_raise_kl_multiplies_at_each_alarm_resumes_raised_and_needs_a_kl_penalty():
    import pytest

    from conftest import compose_config
    from train.trainer.config import ConfigError, validate

    gate = ForgettingGate(["rewards/test"], max_drop=0.0, action="raise_kl", kl_factor=3.0)
    assert gate.raise_kl() == 3.0 and gate.raise_kl() == 9.0
    resumed = ForgettingGate(["rewards/test"], max_drop=0.0, action="raise_kl", kl_factor=3.0)
    resumed.load_state_dict(gate.state_dict())
    assert resumed.kl_scale == 9.0
    with pytest.raises(ConfigError, match=r"trainer\.forgetting\.action.*actor\.kl\.coef=0\.01"):
        validate(compose_config(["trainer.test_freq=10", "trainer.forgetting.watch=[rewards/test]",
                                 "trainer.forgetting.action=raise_kl"]))


def test_max_kl_is_refused_where_the_run_holds_no_starting_policy_to_measure_from():
    """The rule StartDrift uses (drift.holds_start): a full fine-tune needs the KL reference, loaded from the actor's
    own folder; another reference model is not the start."""
    import pytest

    from conftest import ROOT, compose_config
    from train.trainer.config import ConfigError, validate

    common = ["trainer.test_freq=10", "trainer.test_samples=2", "trainer.forgetting.max_kl=0.1"]
    for extra in ([], ["actor.kl.coef=0.01", f"ref_actor.model_name={ROOT / 'stub' / 'tool_model'}"]):
        with pytest.raises(ConfigError, match=r"trainer\.forgetting\.max_kl.*starting policy"):
            validate(compose_config(common + extra))
    validate(compose_config(common + ["actor.kl.coef=0.01"]))  # the reference is the stub itself: measured
    validate(compose_config(common + ["actor.lora.rank=4"]))  # LoRA: the base is the start
