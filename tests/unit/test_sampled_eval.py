"""The in-training sampled evaluation (trainer.test_samples, train/trainer/evaluation.py): pass@k overall and per
source against a count over every k-subset of each row's replies, written here separately, and the greedy
metrics alongside."""
import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from train.engines.base import SamplingParams
from train.parallel.distributed import DistContext
from train.trainer.evaluation import Evaluator, SampledEval
from train.workers.rollout import PROMPT_TOO_LONG, Sample


class ScriptedRollout:
    """Stands in for the rollout worker (whose generation other tests cover): replies whose rewards are drawn from
    each row's own pass rate, reproducibly, and a row whose prompt fills the context."""

    def __init__(self):
        self.calls = []

    def rollout(self, rows, n, sampling, seed, what=""):
        self.calls.append((n, sampling.temperature))
        rng = random.Random(seed)
        out = []
        for g, row in enumerate(rows):
            for _ in range(n):
                reason = PROMPT_TOO_LONG if row.get("too_long") else "stop"
                reward = float(rng.random() < row["rate"]) if reason == "stop" else 0.0
                out.append(Sample(group=g, messages=[], answer=None, ids=[1], action_mask=[0], sampler_logprobs=[0.0],
                                  reward=reward, finish_reason=reason, source=row["source"]))
        return out, 0.0


def brute_pass_at_k(rewards: list[float], k: int) -> float:
    subsets = list(itertools.combinations(rewards, k))
    return sum(any(r >= 1.0 for r in s) for s in subsets) / len(subsets)


def test_pass_at_k_in_training_is_the_share_of_passing_k_subsets_per_row_and_source():
    rows = [{"rate": r, "source": s} for r, s in zip([0.1, 0.5, 0.9, 0.0, 1.0, 0.3], "aabbab")]
    rows.append({"rate": 0.5, "source": "a", "too_long": True})  # never rolled out: not a row of pass@k
    log = SimpleNamespace(event=lambda *a, **k: None)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), mesh=None)
    rollout = ScriptedRollout()
    sampled = SampledEval(n=5, ks=(1, 2, 5), temperature=0.8, success=1.0)
    evaluate = Evaluator(ctx, rows=rows, sources=["a", "b"], rollout=rollout, engine=SimpleNamespace(wake=lambda: None),
                         sampling=SamplingParams(temperature=0.0), seed=7, report=SimpleNamespace(log=log),
                         sampled=sampled)
    evaluate.report.prompt_overflows_at = lambda *a: None
    out = evaluate(3)
    assert rollout.calls == [(1, 0.0), (5, 0.8)]  # greedy, then n replies per row at trainer.test_temperature
    # the same replies again, from the scripted rollout's seed, to count k-subsets
    replies, _ = ScriptedRollout().rollout(rows, 5, SamplingParams(), evaluate_seed(evaluate))
    by_row = [[s.reward for s in replies[g * 5:(g + 1) * 5]] for g in range(len(rows) - 1)]
    for k in (1, 2, 5):
        expected = sum(brute_pass_at_k(r, k) for r in by_row) / len(by_row)
        assert out[f"pass@{k}/test"] == pytest.approx(expected, abs=1e-12)
        for source in "ab":
            mine = [r for r, row in zip(by_row, rows) if row["source"] == source]
            assert out[f"pass@{k}/test/{source}"] == pytest.approx(sum(brute_pass_at_k(r, k) for r in mine) / len(mine))
    assert out["rewards/test_sampled"] == pytest.approx(sum(map(sum, by_row)) / (5 * len(by_row)))
    assert out["pass@1/test"] == pytest.approx(out["rewards/test_sampled"])  # 0/1 rewards
    assert 0 < out["pass@1/test"] < out["pass@2/test"] < out["pass@5/test"] < 1


def evaluate_seed(evaluate: Evaluator) -> int:
    from train.workers.rollout import sample_seed

    return sample_seed(evaluate.seed, -2, 0)


def test_pass_k_above_the_samples_is_a_config_error():
    from conftest import compose_config
    from train.trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"trainer\.test_pass_k"):
        validate(compose_config(["trainer.test_samples=4", "trainer.test_pass_k=[1,8]"]))
    with pytest.raises(ConfigError, match=r"trainer\.forgetting\.watch"):
        validate(compose_config(["trainer.forgetting.watch=[actor/loss]"]))
