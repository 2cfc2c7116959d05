"""The governor's detection rule and its in-memory snapshots, without a trainer (the end-to-end
rollback is in tests/integration/test_trainer.py)."""
from types import SimpleNamespace
import math

import pytest
import torch

from train.trainer.governor import Governor, Snapshot, detect


def gov(**kw):
    args = dict(watch=["actor/loss", "actor/grad_norm"], window=5, k_sigma=4.0, min_history=3, min_panics=1,
                rel_std_floor=0.0)
    args.update(kw)
    return Governor(**args)


def test_detect():
    hist = [1.0, 1.2, 0.8, 1.1, 0.9]  # mean 1, std ~0.141
    assert detect("actor/loss", math.nan, [], 4, 3, 0.0) == "actor/loss is nan"
    assert "inf" in detect("actor/grad_norm", math.inf, hist, 4, 3, 0.0)
    assert detect("actor/loss", 50.0, hist[:2], 4, 3, 0.0) is None  # too little history to judge a spike
    assert detect("actor/loss", 1.5, hist, 4, 3, 0.0) is None  # 3.5 sigma
    assert "spike" in detect("actor/loss", 1.6, hist, 4, 3, 0.0)  # 4.2 sigma
    assert "spike" in detect("actor/loss", 0.4, hist, 4, 3, 0.0)  # losses: both directions
    assert detect("actor/grad_norm", 0.01, hist, 4, 3, 0.0) is None  # norms: only upwards
    # the relative floor: a flat history does not turn noise into spikes
    flat = [2.0, 2.0, 2.0]
    assert "spike" in detect("actor/grad_norm", 2.1, flat, 4, 3, 0.0)
    assert detect("actor/grad_norm", 2.1, flat, 4, 3, 0.25) is None
    assert "spike" in detect("actor/grad_norm", 4.1, flat, 4, 3, 0.25)


def test_a_large_relative_weight_change_panics_from_the_first_step():
    # No history needed: lr=1e3 moves the weight norm by ~1000x at step 1.
    assert "max_weight_change=0.05" in detect("actor/weight_change", 12.0, [], 4, 3, 0.0, 0.05)
    assert detect("actor/weight_change", 2e-5, [], 4, 3, 0.0, 0.05) is None
    assert detect("actor/weight_change", 0.04, [1e-5] * 10, 4, 3, 0.0, 0.05) is None  # not a k-sigma judgement
    g = gov(watch=["actor/weight_change"], max_weight_change=0.05)
    assert g.observe({"actor/weight_change": 3.0}).action == "rollback"


def test_weight_norm_counts_each_shard_once():
    """Trainable.local_weight_square (what the actor's update reduces) on one rank against a float64 norm."""
    from train.models.trainable import Trainable

    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    holder = SimpleNamespace(model=model, device=torch.device("cpu"), masters=None)
    expected = math.sqrt(sum(float((p.detach().double() ** 2).sum()) for p in model.parameters()))
    assert abs(Trainable.local_weight_square(holder) ** 0.5 - expected) < 1e-6 * expected


def test_governor_window_and_rollback():
    g = gov()
    for v in [1.0, 1.1, 0.9, 1.0]:
        assert g.observe({"actor/loss": v, "actor/grad_norm": 2.0 * v}).action == "accept"
    verdict = g.observe({"actor/loss": 1.0, "actor/grad_norm": 100.0})
    assert verdict.action == "rollback" and "actor/grad_norm spike" in verdict.reason
    assert g.history["actor/grad_norm"] == [2.0, 2.2, 1.8, 2.0]  # a rejected value never enters the window
    for v in [1.0] * 6:
        g.observe({"actor/loss": v, "actor/grad_norm": 2.0})
    assert len(g.history["actor/loss"]) == 5  # the window slides
    assert g.observe({"critic/value_loss": math.nan}).action == "accept"  # unwatched metrics are ignored


def test_min_panics_holds_then_rolls_back_or_recovers():
    g = gov(min_panics=2)
    for v in [1.0, 1.0, 1.0]:
        g.observe({"actor/loss": v})
    assert g.observe({"actor/loss": math.inf}).action == "hold"
    assert g.observe({"actor/loss": math.nan}).action == "rollback"  # two in a row
    assert g.observe({"actor/loss": math.nan}).action == "hold"  # the count restarts after a rollback
    assert g.observe({"actor/loss": 1.0}).action == "accept"  # a good step clears a pending panic
    assert g.panics == 0
    again = gov(min_panics=2)
    again.load_state_dict(g.state_dict())
    assert again.history == g.history and again.panics == g.panics


def test_snapshot_restores_weights_optimizer_moments_and_scheduler():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    x = torch.randn(16, 4)

    def step(scale=1.0):
        (model(x).pow(2).mean() * scale).backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    worker = {"actor": SimpleNamespace(state_parts=lambda: {"model": model, "optimizer": opt, "scheduler": sched})}
    fresh = Snapshot(worker)  # before any step: no optimizer state yet
    step()
    step()
    snap = Snapshot(worker)
    good = ({k: v.clone() for k, v in model.state_dict().items()},
            {id_: {k: v.clone() for k, v in s.items()} for id_, s in opt.state_dict()["state"].items()},
            sched.state_dict()["last_epoch"], opt.param_groups[0]["lr"])
    step(scale=1e6)  # a catastrophic update
    step()
    snap.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v, good[0][k])
    for id_, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, good[1][id_][k]), k
    assert sched.state_dict()["last_epoch"] == good[2] and opt.param_groups[0]["lr"] == good[3]
    # the restored optimizer continues exactly as if the bad steps never happened
    step()
    after = {k: v.clone() for k, v in model.state_dict().items()}
    snap.restore()
    step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, after[k])
    fresh.restore()
    assert not opt.state  # back to before the first step
    with pytest.raises(AssertionError):
        for k, v in model.state_dict().items():
            assert torch.equal(v, good[0][k])


def test_a_non_finite_gradient_norm_skips_the_optimizer_step():
    """The step every update runs (Trainable.optimizer_step -> clip_and_step): with a NaN gradient
    the weights and Adam's state stay as they were, the gradients are cleared and the schedule moves on."""
    from train.models.optim import build_optimizer, build_scheduler, clip_and_step

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = build_optimizer(model, 1e-2, (0.9, 0.999), 0.0)
    scheduler = build_scheduler(optimizer, 10, 0.0, "constant", 1.0)
    model(torch.randn(2, 4)).sum().backward()
    clip_and_step(model, optimizer, scheduler, 1.0)  # one real step: Adam state exists
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    (model(torch.randn(2, 4)).sum() * float("nan")).backward()
    norm = clip_and_step(model, optimizer, scheduler, 1.0)
    assert math.isnan(norm)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(optimizer.state.values(), moments))
    assert all(p.grad is None for p in model.parameters()) and scheduler.last_epoch == 2
