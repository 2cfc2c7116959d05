"""train/workers/rubric.py: a rubric's reward is the weighted mean of its criteria; a criterion that fails or
times out scores 0 alone; scores are cached per conversation; the criteria reach the sample and the metrics."""
from __future__ import annotations

import asyncio
import pickle
import time
from types import SimpleNamespace

import pytest
import torch

from train.trainer.step import rubric_metrics
from train.workers.environment import Environment
from train.workers.rollout import Sample
from train.workers.rubric import Criterion, Rubric, RubricScore, regex

CONVO = [{"role": "user", "content": "2 + 3"}, {"role": "assistant", "content": "so <answer>5</answer>"}]


def correct(messages, answer, state):
    return float(messages[-1]["content"].endswith(f"<answer>{answer}</answer>"))


def test_the_reward_is_the_weighted_mean_of_the_criteria():
    rubric = Rubric([regex("format", r"<answer>\d+</answer>", weight=1.0), Criterion("correct", correct, weight=3.0)])
    right = asyncio.run(rubric.score(CONVO, "5"))
    wrong = asyncio.run(rubric.score(CONVO, "6"))
    assert right == 1.0 and right.criteria == {"format": 1.0, "correct": 1.0} and not right.errors
    assert wrong == pytest.approx(0.25) and wrong.criteria == {"format": 1.0, "correct": 0.0}


def test_a_failing_or_slow_criterion_scores_zero_alone_and_says_why():
    async def slow(messages, answer, state):
        await asyncio.sleep(5)
        return 1.0

    def broken(messages, answer, state):
        raise RuntimeError("judge unreachable")

    rubric = Rubric([Criterion("correct", correct), Criterion("slow", slow, timeout_s=0.05),
                     Criterion("broken", broken), Criterion("wild", lambda m, a, s: 7.0)])
    start = time.perf_counter()
    out = asyncio.run(rubric.score(CONVO, "5"))
    assert time.perf_counter() - start < 2  # the slow judge cost its timeout, not 5 s
    assert out == pytest.approx(0.25) and out.criteria == {"correct": 1.0, "slow": 0.0, "broken": 0.0, "wild": 0.0}
    assert out.errors == {"slow": "timed out after 0.05 s", "broken": "RuntimeError: judge unreachable",
                          "wild": "scored 7.0, outside [0, 1]"}


def test_a_conversation_is_scored_once_and_criteria_share_its_state():
    calls = []

    def parse(messages, answer, state):
        calls.append(1)
        state["parsed"] = messages[-1]["content"][-10:]
        return 1.0

    rubric = Rubric([Criterion("parse", parse)], cache_size=2)
    for _ in range(3):
        asyncio.run(rubric.score(CONVO, "5"))
    assert len(calls) == 1
    asyncio.run(rubric.score(CONVO, "6"))
    assert len(calls) == 2


def test_bad_rubrics_are_refused_and_scores_pickle_with_their_criteria():
    with pytest.raises(ValueError, match="distinct names"):
        Rubric([Criterion("a", correct), Criterion("a", correct)])
    with pytest.raises(ValueError, match="letters, digits"):
        Criterion("has space", correct)
    with pytest.raises(ValueError, match="weight"):
        Criterion("a", correct, weight=-1)
    score = RubricScore(0.5, {"a": 0.5}, {"b": "x"})
    back = pickle.loads(pickle.dumps(score))
    assert back == 0.5 and back.criteria == {"a": 0.5} and back.errors == {"b": "x"}


def test_an_env_module_with_a_rubric_gives_the_rollout_its_criteria(tmp_path):
    env = tmp_path / "rubric_env.py"
    env.write_text("from train.workers.rubric import Criterion, Rubric, regex\n"
                   "RUBRIC = Rubric([regex('format', r'<answer>'), Criterion('long', lambda m, a, s: 1.0, 3.0)])\n"
                   "reward_fn = RUBRIC.reward_fn\n")
    e = Environment(str(env), timeout_s=10, max_workers=2, max_turns=1)
    try:
        value = asyncio.run(e.reward(CONVO, "5"))
    finally:
        e.close()
    assert value == 1.0 and value.criteria == {"format": 1.0, "long": 1.0}


def test_the_metrics_hold_each_criterions_mean_overall_and_per_source():
    def sample(criteria, source):
        return Sample(group=0, messages=[], answer=None, ids=[], action_mask=[], sampler_logprobs=[],
                      criteria=criteria, source=source)
    samples = [sample({"format": 1.0, "correct": 1.0}, "math"), sample({"format": 0.0, "correct": 0.0}, "math"),
               sample({"format": 1.0}, "code"), sample({}, "code")]
    ctx = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    known: set[str] = set()
    out = rubric_metrics(samples, ["math", "code"], ctx, known, {"format", "correct"})
    assert out == {"rubric/correct": 0.5, "rubric/format": 2 / 3, "rubric/correct/math": 0.5,
                   "rubric/format/math": 0.5, "rubric/format/code": 1.0}
    assert known == {"format", "correct"}  # later steps reduce these without gathering names again
    assert rubric_metrics(samples[:2], ["math", "code"], ctx, known, None)["rubric/format"] == 0.5
    assert rubric_metrics([sample({}, None)], [], ctx, set(), None) == {}
