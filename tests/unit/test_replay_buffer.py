"""Prioritized replay (data.replay.*, train/trainer/replay.py): what a group is worth, what a step draws, what leaves
the buffer, and that a buffer restored from its state draws what the original would."""
import dataclasses
from collections import Counter

import pytest

from conftest import compose_config
from train.datasets.config import ReplayConfig
from train.trainer.replay import ReplayBuffer
from train.utils.typed_config import build
from train.workers.rollout import Sample

BASE = dataclasses.replace(build(ReplayConfig, compose_config([]).data.replay, "data.replay"), enable=True)
N = 4  # group size


def group(rewards: list[float], tag: str = "", criteria: list[dict] | None = None) -> list[Sample]:
    criteria = criteria or [{}] * len(rewards)
    return [Sample(group=0, messages=[{"role": "user", "content": tag}], answer=None, ids=[1, 2, 3],
                   action_mask=[0, 1, 1], sampler_logprobs=[0.0, -1.0, -2.0], reward=r, shaped_reward=r, criteria=c)
            for r, c in zip(rewards, criteria)]


def buffer(**changes) -> ReplayBuffer:
    return ReplayBuffer(dataclasses.replace(BASE, **changes), N, pass_threshold=1.0, prompts_per_rank=8, seed=3,
                        rank=0)


def tags(samples: list[Sample]) -> list[str]:
    return [samples[i].messages[0]["content"] for i in range(0, len(samples), N)]


def test_a_rare_success_is_worth_more_than_a_common_one_and_a_saturated_group_nothing():
    b = buffer()
    assert b.priority(group([1, 0, 0, 0])) == pytest.approx(0.75)
    assert b.priority(group([1, 1, 1, 0])) == pytest.approx(0.25)
    assert b.priority(group([1, 1, 1, 1])) == 0 and b.priority(group([0, 0.5, 0, 0])) == 0  # nothing to learn / no pass
    # a rubric criterion decides the pass when named (the reward would say otherwise)
    graded = group([0.2, 0.2, 0.2, 0.2], criteria=[{"tests": 1.0}, {"tests": 0.0}, {"tests": 0.0}, {"tests": 0.0}])
    assert buffer(criterion="tests").priority(graded) == pytest.approx(0.75) and b.priority(graded) == 0


def test_advantage_priority_is_the_mean_absolute_deviation_of_the_groups_rewards():
    rewards = [0.1, 0.9, 0.4, 0.0]
    mean = sum(rewards) / 4
    expected = sum(abs(r - mean) for r in rewards) / 4
    assert buffer(priority="advantage").priority(group(rewards)) == pytest.approx(expected)
    assert buffer(priority="uniform").priority(group(rewards)) == 1.0
    assert buffer(priority="uniform").priority(group([0.5] * 4)) == 0.0


def test_draws_follow_priority_to_the_power_alpha():
    """One group per draw over 6000 steps: each group's frequency is its priority ** alpha over the sum (binomial
    error ~0.006), with no group drawn twice in one step when several are drawn."""
    for alpha in (1.0, 2.0):
        b = buffer(alpha=alpha, share=1 / 8, max_age=10 ** 6, max_uses=10 ** 6)
        b.add(0, group([1, 0, 0, 0], "a") + group([1, 1, 0, 0], "b") + group([1, 1, 1, 0], "c"))
        counts = Counter(g.samples[0].messages[0]["content"] for step in range(1, 6001) for g in b.draw(step))
        weights = {"a": 0.75 ** alpha, "b": 0.5 ** alpha, "c": 0.25 ** alpha}
        for name, w in weights.items():
            assert counts[name] / 6000 == pytest.approx(w / sum(weights.values()), abs=0.025), (alpha, counts)
    b = buffer(share=3 / 8)
    b.add(0, group([1, 0, 0, 0], "a") + group([1, 1, 0, 0], "b") + group([1, 1, 1, 0], "c"))
    assert sorted(tags([s for g in b.draw(1) for s in g.samples])) == ["a", "b", "c"]


def test_a_step_replays_only_earlier_groups_and_they_leave_by_age_uses_and_capacity():
    b = buffer(share=2 / 8, max_age=2, max_uses=2, capacity=3)
    fresh = group([1, 0, 0, 0], "s1")
    got, drawn = b.mix(1, fresh)
    assert got == fresh and drawn == []  # nothing before step 1
    got, drawn = b.mix(2, group([1, 1, 0, 0], "s2"))
    assert tags(got) == ["s2", "s1"]  # the fresh groups first, then the replayed
    got, drawn = b.mix(3, group([0, 0, 0, 0], "s3"))  # no success: not kept
    assert sorted(tags(got)[1:]) == ["s1", "s2"] and [g.uses for g in b.groups] == [1]  # s1 used twice: gone
    got, _ = b.mix(5, [])
    assert tags(got) == []  # s2 (step 2) is older than max_age=2 at step 5
    for step, rewards in enumerate(([1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]), start=10):
        b.add(step, group(rewards, f"t{step}"))
    # capacity 3: the lowest priority (t11: 0.25) left first
    assert sorted(g.samples[0].messages[0]["content"] for g in b.groups) == ["t10", "t12", "t13"]


def test_a_restored_buffer_draws_what_the_original_would():
    import pickle

    b = buffer(share=2 / 8, capacity=5, max_uses=3)
    for step in range(1, 6):
        b.mix(step, group([1, 0, 0, 0], f"a{step}") + group([1, 1, 0, 0], f"b{step}"))
    again = buffer(share=2 / 8, capacity=5, max_uses=3)
    again.load_state_dict(pickle.loads(pickle.dumps(b.state_dict())))  # as a checkpoint keeps it
    for step in range(6, 12):
        fresh = group([1, 1, 1, 0], f"c{step}")
        assert tags(b.mix(step, fresh)[0]) == tags(again.mix(step, fresh)[0])
    other_rank = ReplayBuffer(b.cfg, N, 1.0, 8, seed=3, rank=1)
    other_rank.load_state_dict(b.state_dict())
    drawn = lambda buf, step: tags([s for g in buf.draw(step) for s in g.samples])  # noqa: E731
    assert any(drawn(b, step) != drawn(other_rank, step) for step in range(20, 30))  # each rank draws its own


def test_replay_config_errors_name_the_key():
    from train.trainer.config import ConfigError, validate

    for overrides, key in [(["data.replay.priority=recent"], "data.replay.priority"),
                           (["data.replay.share=0"], "data.replay.share"),
                           (["data.replay.enable=true", "rollout.inflight=true", "rollout.max_staleness=1"],
                            "data.replay.enable"),
                           (["data.replay.enable=true", "data.replay.priority=advantage", "data.replay.criterion=x"],
                            "data.replay.criterion")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(compose_config(overrides))


def test_a_source_the_forgetting_gate_flags_is_drawn_favour_failing_times_more_until_it_passes():
    """Adaptive replay: equal priorities, the flagged source's groups weigh 4x: it is drawn 4/5 of the time (one
    draw per step over 4000 steps); the gate names the sources whose rewards/test/<source> fell, and forgets them
    when an evaluation passes."""
    from train.trainer.forgetting import ForgettingGate

    gate = ForgettingGate(["rewards/test/old", "rewards/test"], max_drop=0.05, action="warn")
    gate.judge(0, {"rewards/test": 0.5, "rewards/test/old": 0.5})
    assert gate.judge(10, {"rewards/test": 0.3, "rewards/test/old": 0.3}) is not None
    assert gate.failing == ["old"]  # the overall metric names no source
    b = buffer(share=1 / 8, max_age=10 ** 6, max_uses=10 ** 6, favour_failing=4.0)
    old, new = group([1, 0, 0, 0], "old"), group([1, 0, 0, 0], "new")
    for s in old:
        s.source = "old"
    b.add(0, old + new)
    b.favour(gate.failing)
    counts = Counter(tags([s for g in b.draw(step) for s in g.samples])[0] for step in range(1, 4001))
    assert counts["old"] / 4000 == pytest.approx(0.8, abs=0.025)
    assert gate.judge(20, {"rewards/test": 0.5, "rewards/test/old": 0.5}) is None and gate.failing == []
    b.favour(gate.failing)
    counts = Counter(tags([s for g in b.draw(step) for s in g.samples])[0] for step in range(1, 4001))
    assert counts["old"] / 4000 == pytest.approx(0.5, abs=0.025)


def test_a_replayed_sample_comes_back_exactly_as_it_was_kept_and_is_kept_packed():
    """The buffer holds the per-token fields as typed arrays (25 bytes a token, not ~120 in lists of Python
    objects) and hands back lists equal to the originals, float64 log-probs included; training on a drawn sample
    (it may be masked in place) does not change the kept one."""
    import math
    import pickle
    import tracemalloc

    from train.trainer.replay import pack

    b = buffer(share=1 / 8)
    fresh = group([1, 0, 0, 0], "a")
    n = 4000
    for i, s in enumerate(fresh):
        s.ids = [(7919 * (i + t)) % 151_000 for t in range(n)]
        s.action_mask = [t % 3 != 0 for t in range(n)]
        s.sampler_logprobs = [-math.pi * t / n for t in range(n)]
        s.token_versions = [1000 + t % 5 for t in range(n)]
    b.add(1, fresh)
    got, _ = b.mix(2, [])
    assert [(s.ids, s.action_mask, s.sampler_logprobs, s.token_versions) for s in got] == \
        [(s.ids, s.action_mask, s.sampler_logprobs, s.token_versions) for s in fresh]
    assert all(type(s.ids) is list and type(s.sampler_logprobs[0]) is float for s in got)
    got[0].action_mask[:] = [0] * n  # actor.mask_truncated-style, on the drawn copy
    assert list(b.groups[0].samples[0].action_mask) == fresh[0].action_mask
    assert len(pickle.dumps(b.state_dict())) < 4 * n * 26  # the checkpoint state: ~25 bytes a token
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    packed = [pack(s) for s in fresh]
    packed_bytes = tracemalloc.get_traced_memory()[0] - before
    as_lists = [([x + 0 for x in s.ids], list(s.action_mask), [x + 0.0 for x in s.sampler_logprobs],
                 [x + 0 for x in s.token_versions]) for s in got]  # unpacked, each value its own object (as decoded)
    lists_bytes = tracemalloc.get_traced_memory()[0] - before - packed_bytes
    tracemalloc.stop()
    assert packed_bytes < 4 * n * 27 and lists_bytes > 3.5 * packed_bytes, (packed_bytes, lists_bytes, len(packed), len(as_lists))
