"""Evaluation on the test set: greedy `rewards/test` and `rewards/test/<source>` per source; with
`trainer.test_samples` n, also n sampled replies per row: `rewards/test_sampled` and the unbiased `pass@k/test`
(and per source) for each k of `trainer.test_pass_k`. The run's history of test rewards is saved with
checkpoints (the closing line spans resumes). Cost: (1 + n) x the test rows' generation every `test_freq` steps,
each rank generating its share of the rows; one all-reduce per pass."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from train.algorithms.pass_at_k import pass_at_k
from train.engines.base import SamplingParams
from train.parallel.collectives import all_reduce_sum
from train.parallel.distributed import DistContext
from train.trainer.report import RunReport
from train.trainer.step import per_source_sums, split_triples
from train.workers.rollout import UNUSABLE_PROMPTS, Sample, sample_seed


@dataclass(frozen=True)
class SampledEval:
    """pass@k at each evaluation: `n` replies per row at `temperature`; a reply passes when its reward is at least
    `success` (data.curriculum.pass_threshold)."""
    n: int
    ks: tuple[int, ...]
    temperature: float
    success: float


class Evaluator:
    def __init__(self, ctx: DistContext, *, rows: list[dict], sources: list[str], rollout, engine,
                 sampling: SamplingParams, seed: int, report: RunReport, sampled: SampledEval | None = None,
                 drift: Callable[[list[Sample], list[str]], dict[str, float]] | None = None) -> None:
        self.ctx, self.rows, self.sources = ctx, rows, sources
        self.rollout, self.engine, self.sampling, self.seed = rollout, engine, sampling, seed
        self.report, self.sampled = report, sampled
        self.drift = drift  # measured on the sampled replies: kl_to_start/test (train/trainer/drift.py)
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
        if self.sampled is not None:
            out.update(self.pass_at_k(step, rows))
        self.report.log.event("eval", step, {**out, "n": count, "env_errors": errors})
        return out

    def pass_at_k(self, step: int, rows: list[dict]) -> dict[str, float]:
        """This rank's `rows`, n sampled replies each: the mean sampled reward and pass@k, overall and per source."""
        cfg, ctx = self.sampled, self.ctx
        sampling = replace(self.sampling, temperature=cfg.temperature)
        samples, _ = self.rollout.rollout(rows, cfg.n, sampling, sample_seed(self.seed, -2, ctx.rank),
                                          what=f"step {step}'s sampled evaluation")
        names = [None, *self.sources]  # None: every row
        sums = [0.0] * (len(names) * (len(cfg.ks) + 1)) + [0.0, 0.0]  # per name: pass@k sums and rows; rewards
        for g in range(len(samples) // cfg.n):
            group = samples[g * cfg.n:(g + 1) * cfg.n]
            if group[0].finish_reason in UNUSABLE_PROMPTS:
                continue
            passed = sum(s.reward >= cfg.success for s in group)
            for i, name in enumerate(names):
                if name is None or name == group[0].source:
                    base = i * (len(cfg.ks) + 1)
                    for j, k in enumerate(cfg.ks):
                        sums[base + j] += pass_at_k(cfg.n, passed, k)
                    sums[base + len(cfg.ks)] += 1.0
            sums[-2] += sum(s.reward for s in group)
            sums[-1] += cfg.n
        sums = all_reduce_sum(sums, ctx.device)
        out = {"rewards/test_sampled": sums[-2] / max(sums[-1], 1.0)}
        if self.drift is not None:
            out.update(self.drift([s for s in samples if s.finish_reason not in UNUSABLE_PROMPTS], self.sources))
        for i, name in enumerate(names):
            base = i * (len(cfg.ks) + 1)
            n_rows = sums[base + len(cfg.ks)]
            if n_rows > 0 and (name is None or len(self.sources) > 1):
                for j, k in enumerate(cfg.ks):
                    out[f"pass@{k}/test" + (f"/{name}" if name else "")] = sums[base + j] / n_rows
        return out

    def state_dict(self) -> list[tuple[int, float]]:
        return list(self.history)

    def load_state_dict(self, state: list) -> None:
        self.history = [tuple(x) for x in state]
