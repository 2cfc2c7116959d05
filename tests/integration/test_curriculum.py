"""Per-prompt pass rates and the sampling policies that use them (data.curriculum.*), and the
train/test contamination check (issue 19)."""
import dataclasses
import json

import pytest

from conftest import STUB_MATH, compose_config, read_jsonl, run_trainer, stub_train_slice
from test_trainer import assert_same, prompts_by_step
from train.datasets.contamination import check_contamination
from train.datasets.config import CurriculumConfig
from train.datasets.curriculum import Curriculum, PromptStats, prompt_id, unit_draw
from train.datasets.dataloader import build_dataloader
from train.datasets.loading import load_rows
from train.runtime.checkpoint import consolidate
from train.utils.typed_config import build

# The defaults of config/grpo.yaml; each test changes what it needs with dataclasses.replace.
BASE = build(CurriculumConfig, compose_config([]).data.curriculum, "data.curriculum")


def rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(n)]


def test_the_ema_follows_a_hand_computation():
    stats = PromptStats(decay=0.7)
    for step, rate in enumerate([1.0, 0.0, 0.5], start=1):
        stats.update(step, [("a", rate)])
    s = stats.get("a")
    # 1.0; 0.7 * 1.0 + 0.3 * 0.0 = 0.7; 0.7 * 0.7 + 0.3 * 0.5 = 0.64
    assert s.visits == 3 and s.last_step == 3 and abs(s.ema - 0.64) < 1e-12
    again = PromptStats(0.7)
    again.load_state_dict(stats.state_dict())
    assert again.get("a") == s
    assert prompt_id({"id": 7, "messages": []}) == "7"
    assert prompt_id(rows(2)[0]) == prompt_id(json.loads(json.dumps(rows(2)[0]))) != prompt_id(rows(2)[1])


def test_the_pass_rate_summary_kept_step_by_step_equals_a_recount():
    """Curriculum.record touches only the step's prompts; its summary must equal a recount over every
    prompt seen, and a resume continues it exactly."""
    import random

    data = rows(50)
    cur = Curriculum(dataclasses.replace(BASE, policy="skip_saturated", low=0.1, high=0.9), data, 0)
    draw = random.Random(0)
    for step in range(1, 120):
        cur.record(step, [(cur.id_of(draw.randrange(50)), draw.choice([0.0, 0.25, 0.5, 1.0])) for _ in range(8)])
        got, seen = cur.take_counters(), list(cur.stats.stats.values())
        assert got["curriculum/prompts_seen"] == len(seen)
        assert abs(got["curriculum/pass_rate_mean"] - sum(s.ema for s in seen) / len(seen)) < 1e-12
        assert got["curriculum/never_solved"] == sum(s.ema <= 0.1 for s in seen) / len(seen)
        assert got["curriculum/always_solved"] == sum(s.ema >= 0.9 for s in seen) / len(seen)
    again = Curriculum(cur.cfg, data, 0)
    again.load_state_dict(cur.state_dict())
    assert again.take_counters() == {**cur.take_counters(), "curriculum/skipped": 0.0}


def test_skip_saturated_skips_and_rechecks_by_the_rule():
    data = rows(4)
    cfg = dataclasses.replace(BASE, policy="skip_saturated", min_visits=2, low=0.0, high=1.0, recheck=0.25)
    cur = Curriculum(cfg, data, 3)
    solved = cur.id_of(0)
    cur.stats.update(1, [(solved, 1.0)])
    assert cur.accept(0, 0, 0)  # one visit: not judged yet
    cur.stats.update(2, [(solved, 1.0), (cur.id_of(2), 0.5)])
    for epoch in range(40):  # always solved: taken exactly when the position's draw is below recheck
        assert cur.accept(0, epoch, 5) == (unit_draw(3, epoch, 5) < 0.25)
    assert cur.accept(1, 0, 1) and cur.accept(2, 0, 2)  # unseen, and half solved: always taken
    assert any(cur.accept(0, e, 5) for e in range(40))  # it comes back


def test_prioritized_takes_prompts_in_proportion_to_their_weight():
    data = rows(2)
    cur = Curriculum(dataclasses.replace(BASE, policy="prioritized", floor=0.02), data, 0)
    cur.stats.update(1, [(cur.id_of(0), 0.5), (cur.id_of(1), 1.0)])
    n = 4000
    half = sum(cur.accept(0, e, 0) for e in range(n)) / n
    solved = sum(cur.accept(1, e, 1) for e in range(n)) / n
    assert half == 1.0  # p(1-p) + floor is the largest weight: always taken
    assert abs(solved - 0.02 / 0.27) < 0.015  # floor / (0.25 + floor)


def test_no_prompt_is_unreachable_and_batches_fill():
    data = rows(10)
    cur = Curriculum(dataclasses.replace(BASE, policy="skip_saturated", min_visits=1, recheck=0.05), data, 0)
    cur.stats.update(1, [(cur.id_of(i), 1.0) for i in range(10)])  # every prompt "always solved"
    loader = build_dataloader(data, batch_size=4, rank=0, world_size=1, seed=0, accept=cur.accept)
    seen = set()
    for _ in range(100):
        batch = loader.next_batch()
        assert len(batch) == 4  # a batch fills even when the policy refuses everything
        seen |= {r["answer"] for r in batch}
    assert len(seen) == 10
    # With the policy off the loader draws exactly as it always did.
    plain, hooked = (build_dataloader(data, batch_size=4, rank=0, world_size=1, seed=0, accept=a)
                     for a in (None, lambda i, e, p: True))
    assert [plain.next_batch() for _ in range(7)] == [hooked.next_batch() for _ in range(7)]


def test_contamination_finds_planted_duplicates_and_none_on_the_stub_split():
    train = load_rows(str(STUB_MATH / "train.jsonl"))
    test = load_rows(str(STUB_MATH / "test.jsonl"))
    assert not check_contamination(train, test).found
    long = "please read the following passage about the history of the city and answer the question at the end"
    train_rows = [{"messages": [{"role": "user", "content": long + " what year was it founded"}]}]
    planted = [{"messages": [{"role": "user", "content": long.upper() + " what year was it founded"}]},  # exact after case
               {"messages": [{"role": "user", "content": "Context: " + long + ". Who built the bridge?"}]},  # 13-gram
               {"messages": [{"role": "user", "content": "an unrelated question about chemistry and its laws"}]}]
    report = check_contamination(train_rows, planted)
    assert report.exact == [0] and report.near == [1]
    assert "1 of 3 test prompts" in report.summary(13)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return stub_train_slice(tmp_path_factory.mktemp("data") / "train.jsonl", 12)


CURRICULUM = ["data.prompts_per_rollout=4", "data.responses_per_prompt=4", "rollout.dynamic_filtering=false",
              "trainer.test_freq=null", "trainer.log_samples=100", "data.curriculum.policy=skip_saturated",
              "data.curriculum.min_visits=1", "data.curriculum.high=0.5", "data.curriculum.recheck=0.2"]


@pytest.mark.slow
def test_curriculum_skips_and_resumes_exactly(tiny_data, tmp_path):
    """12 prompts, 4 per step, 8 steps: prompts solved by half their group or more are skipped from
    their second epoch on; 4 + resume + 4 steps equals 8 straight (weights, prompts, statistics)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [f"data.train_data_path={tiny_data}", "trainer.total_steps=8", "trainer.save_freq=4", *CURRICULUM]
    run_trainer([f"trainer.save_dir={straight}", *common], nproc=2)
    run_trainer([f"trainer.save_dir={resumed}", f"trainer.load_ckpt_from={straight / 'step4'}", *common], nproc=2)
    assert_same(consolidate(str(straight / "step8")), consolidate(str(resumed / "step8")))
    a, b = prompts_by_step(straight), prompts_by_step(resumed)
    assert all(a[s] == b[s] for s in (5, 6, 7, 8))
    metrics = read_jsonl(straight / "metrics.jsonl")
    assert sum(m["curriculum/skipped"] for m in metrics) > 0  # the policy acted
    stats = read_jsonl(straight / "prompt_stats.jsonl")
    assert len(stats) == 12 and sum(s["visits"] for s in stats) == 8 * 4
    assert read_jsonl(resumed / "prompt_stats.jsonl") == stats


def test_curriculum_config_errors():
    from conftest import compose_config
    from train.trainer.config import ConfigError, validate

    for overrides, key in [(["data.curriculum.policy=hardest"], "data.curriculum.policy"),
                           (["data.curriculum.low=0.9", "data.curriculum.high=0.5"], "data.curriculum.low"),
                           (["data.curriculum.recheck=0"], "data.curriculum.recheck"),
                           (["data.curriculum.floor=0"], "data.curriculum.floor"),
                           (["data.curriculum.policy=prioritized", "rollout.max_staleness=1"], "data.curriculum.policy")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(compose_config(overrides))


@pytest.mark.slow
def test_a_contaminated_test_set_warns_or_stops_the_run(tiny_data, tmp_path):
    """The test file is a slice of the training file: a warning naming the counts (rank 0 checks,
    every rank learns the result), or with data.fail_on_contamination a stop before any model loads."""
    test = tmp_path / "test.jsonl"
    test.write_text("".join(tiny_data.read_text().splitlines(keepends=True)[:3]))
    common = [f"data.train_data_path={tiny_data}", f"data.test_data_path={test}", "trainer.test_freq=1",
              "trainer.total_steps=1", "data.prompts_per_rollout=4", "data.responses_per_prompt=4"]
    proc = run_trainer([f"trainer.save_dir={tmp_path / 'warn'}", *common], nproc=2)
    assert "warning: 3 of 3 test prompts also appear in the training data" in proc.stdout + proc.stderr
    proc = run_trainer([f"trainer.save_dir={tmp_path / 'stop'}", "data.fail_on_contamination=true", *common],
                       nproc=2, check=False)
    assert proc.returncode != 0
    assert "error: data.fail_on_contamination: 3 of 3 test prompts" in proc.stderr
