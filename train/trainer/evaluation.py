"""Greedy evaluation on the test set: `rewards/test` and `rewards/test/<source>` per source, and the
run's history of test rewards (saved with checkpoints: the closing line spans resumes)."""
from __future__ import annotations

from train.engines.base import SamplingParams
from train.parallel.collectives import all_reduce_sum
from train.parallel.distributed import DistContext
from train.trainer.report import RunReport
from train.trainer.step import per_source_sums, split_triples
from train.workers.rollout import UNUSABLE_PROMPTS, sample_seed


class Evaluator:
    def __init__(self, ctx: DistContext, *, rows: list[dict], sources: list[str], rollout, engine,
                 sampling: SamplingParams, seed: int, report: RunReport) -> None:
        self.ctx, self.rows, self.sources = ctx, rows, sources
        self.rollout, self.engine, self.sampling, self.seed = rollout, engine, sampling, seed
        self.report = report
        self.history: list[tuple[int, float]] = []  # (step, test reward)

    def __call__(self, step: int) -> dict[str, float]:
        """`rewards/test` over the whole test set, and `rewards/test/<source>` for each of its sources."""
        ctx = self.ctx
        self.engine.wake()
        rows = self.rows[ctx.rank::ctx.world_size]
        samples, _ = self.rollout.rollout(rows, 1, self.sampling, sample_seed(self.seed, -1, ctx.rank),
                                          what=f"step {step}'s evaluation")
        skipped = [s for s in samples if s.finish_reason in UNUSABLE_PROMPTS]  # prompts that fill the context
        samples = [s for s in samples if s.finish_reason not in UNUSABLE_PROMPTS]
        total, count, errors, n_skipped, *by_source = all_reduce_sum(
            [sum(s.reward for s in samples), float(len(samples)), float(sum(bool(s.env_error) for s in samples)),
             float(len(skipped)), *per_source_sums(samples, self.sources, lambda s: float(bool(s.env_error)))],
            ctx.device)
        if n_skipped:
            self.report.prompt_overflows_at(step, skipped, 1)
        score = total / max(count, 1.0)
        self.history.append((step, score))
        out = {"rewards/test": score}
        for source, (reward_sum, n, _) in zip(self.sources, split_triples(by_source)):
            if n > 0:
                out[f"rewards/test/{source}"] = reward_sum / n
        self.report.log.event("eval", step, {**out, "n": count, "env_errors": errors})
        return out

    def state_dict(self) -> list[tuple[int, float]]:
        return list(self.history)

    def load_state_dict(self, state: list) -> None:
        self.history = [tuple(x) for x in state]
