"""In-flight rollouts (`rollout.inflight=true`): sequences keep generating across weight updates.

About `rollout.inflight_groups` groups (default: max_staleness x prompts_per_rollout, the most that can finish
within the bound at one step's worth per step) (prompts with their `responses_per_prompt` samples) are always in flight.
The rollout side works in **segments**: in one segment every unfinished sample samples at most
`rollout.segment_tokens` more tokens, or finishes (its env turns and its reward included). Step N trains on the
first `prompts_per_rollout` groups, in admission order, that are done; the others go on in the next segment, with
the weights of the next push. So a long reply no longer holds the step back, and the weights change under
sequences that are still generating:

    step N:  take the done groups -> segment N+1 starts in the background (weights N-2) -> update N
             -> wait for segment N+1's generation (at most segment_tokens per sequence, never for the longest
                reply; rewards may go on) -> push weights N-1... (the engine's next segment samples with them)

A segment samples with one weight version, and every token keeps the version and the log-prob it was sampled with
(`Sample.token_versions`), so the loss corrects each token against its own sampler (actor.tis_cap). At the next
segment the earlier tokens are prefilled again with the new weights (their KV cache is recomputed, not kept): the
later tokens are exactly the new policy's samples given the prefix.

Deterministic: segments end by token counts, never by time, and every sample has its own request seed (a turn
paused and resumed continues its stream of uniforms), so which tokens each version sampled never depends on thread
timing. A checkpoint holds every group in flight (tokens, versions, log-probs, the conversation, which is the env's
whole state) and the count of rows admitted, so a resume continues them bit-exactly; on another world size the
saving ranks' groups are dealt to the new ranks (old rank r's to new rank r mod world): none lost, none twice.

The staleness bound (`rollout.max_staleness=k`, per sample): trained at step T, whose weights are T-1's, a sample's
oldest token is at most k versions old. Before each segment of step M a sample whose oldest token would be older
than that when trained at step M is either started again from its prompt with the newest weights
(`rollout.over_stale=requeue`: the bound holds strictly) or finished and trained past the bound (`finish`); its
group is kept either way, and the share and lengths of such samples are logged (`async/over_stale_share`,
`async/over_stale_tokens_mean` and an `over_stale` event with every length), so a bias towards short replies is
not hidden. Admission never draws more prompts than keep `inflight_groups` in flight, which keeps the queue of done
groups short and the lag of the groups in it within the bound.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from train.datasets.config import DataConfig
from train.parallel.collectives import all_reduce_max_many, all_reduce_sum
from train.parallel.distributed import DistContext
from train.runtime.checkpoint import CheckpointError
from train.runtime.watchdog import Watchdog
from train.trainer.prefetch import RolloutPrefetcher, StepRollout
from train.trainer.rollouts import RolloutSource, StepSamples
from train.trainer.step import shape_rewards
from train.workers.config import RolloutConfig
from train.workers.rollout import Group, Sample, sample_seed

# The most segments one step may need before enough groups are done (each segment samples at least one token of
# every unfinished sample, so only a bug gets here).
MAX_SEGMENTS_PER_STEP = 100_000


class InflightRollouts(RolloutSource):
    """`rollout.inflight=true`: see the module docstring."""

    def __init__(self, settings: RolloutConfig, data: DataConfig, ctx: DistContext, *, total_steps: int,
                 watchdog: Watchdog, **parts) -> None:
        super().__init__(settings, data, ctx, **parts)
        self.total_steps, self.watchdog = total_steps, watchdog
        self.k = settings.max_staleness
        self.n = data.responses_per_prompt
        self.per_step = data.prompts_per_rollout // ctx.world_size  # groups this rank trains per step
        self.budget = settings.segment_tokens or default_segment_tokens(self.sampling.max_new_tokens, settings)
        wanted = settings.inflight_groups or self.k * data.prompts_per_rollout
        self.target = max(self.per_step, math.ceil(wanted / ctx.world_size))  # groups in flight on this rank
        self.requeue = settings.over_stale == "requeue"
        self.groups: list[Group] = []  # admitted, not yet trained, in admission order
        self.admitted_rows = 0  # rows admitted so far, all ranks together (the next group's uid; global)
        self.prefetch = RolloutPrefetcher(self._background_segment, settings.async_timeout_s)
        self._counters = self._fresh_counters()

    # -- the step's calls ------------------------------------------------------------------
    def next(self, step: int, trainer_version: int) -> StepSamples:
        self.engine.wake()
        waited: dict[str, float] = {}
        if self.prefetch.in_flight:
            self._drain(waited)
        background = self.prefetch.take(step)
        if background is not None:
            self._add(background)
        for _ in range(MAX_SEGMENTS_PER_STEP):
            self._take_over_stale(trainer_version)
            ready = sum(g.generated for g in self.groups)
            fewest, = all_reduce_max_many([-float(ready)], self.ctx.device)
            if -fewest >= self.per_step:  # every rank has a step's worth (collective: all ranks decide alike)
                break
            self._admit(step)
            self._add(self._segment(step, trainer_version))
        else:
            raise RuntimeError(f"step {step}: {MAX_SEGMENTS_PER_STEP} segments and still not {self.per_step} groups "
                               "done: with rollout.over_stale=requeue samples too long for rollout.max_staleness x "
                               "rollout.segment_tokens tokens start again forever (raise either, or over_stale=finish)")
        taken = [g for g in self.groups if g.generated][: self.per_step]
        self.groups = [g for g in self.groups if not any(g is t for t in taken)]
        self._collect_scores(taken)
        samples = []
        for i, group in enumerate(taken):
            for p in group.members:
                p.sample.group, p.sample.uid = i, group.uid
                samples.append(p.sample)
        shape_rewards(samples, self.settings)
        c = self._counters
        rollout = StepRollout(step, samples, c["seconds"], (c["tokens"], c["engine_s"]), self.loader.state_dict(),
                              [g.row_index for g in taken])
        got = self.collect(step, rollout, trainer_version)
        got.metrics.update(waited)
        got.metrics.update(self._inflight_metrics(step, samples, trainer_version))
        self._counters = self._fresh_counters()
        return got

    def hand_over(self, step: int, metrics: dict[str, float]) -> None:
        """Admit prompts up to `inflight_groups` and start the next segment in the background (with the weights
        the update starts from); after the last step, free the engine as a synchronous run does."""
        if step >= self.total_steps:
            self.engine.sleep()
            return
        self._admit(step + 1)
        self.prefetch.start(step + 1)

    def before_push(self, metrics: dict[str, float]) -> float:
        """The segment in flight samples with the weights it started with: wait until it is paused (at most
        `segment_tokens` per sequence; rewards may go on)."""
        if not self.prefetch.in_flight:
            return 0.0
        return self._drain(metrics, generation_only=True)

    def settle(self, metrics: dict[str, float]) -> float:
        return self._drain(metrics) if self.prefetch.in_flight else 0.0

    def _idle(self) -> bool:
        return self.prefetch.close()

    # -- segments --------------------------------------------------------------------------
    def _background_segment(self, step: int, generated: Callable[[], None]) -> StepRollout:
        # (no collective here: it runs on the prefetch thread; step `step` trains on it at the earliest, with the
        # weights of step - 1)
        return self._segment(step, step - 1, generated)

    def _segment(self, step: int, trainer_version: int, generated: Callable[[], None] | None = None) -> StepRollout:
        """One segment of every unfinished group; a StepRollout holding only its wall time and engine counters
        (the groups change in place, or come back from a rollout rank)."""
        self._requeue_or_flag([g for g in self.groups if not g.generated], trainer_version)
        running = [g for g in self.groups if not g.generated]
        before = self._engine_counters()
        got, seconds = self.rollout.advance(running, self.sampling, self.budget, what=f"step {step}'s segment",
                                            on_generated=generated)
        fresh = {g.uid: g for g in got}
        self.groups = [fresh.get(g.uid, g) for g in self.groups]
        counters = tuple(a - b for a, b in zip(self._engine_counters(), before))
        return StepRollout(step, [], seconds, counters, {})

    def _collect_scores(self, groups: list[Group]) -> None:
        """The rewards of the generated samples of `groups` not scored yet (their reward calls started when they
        were generated, in an earlier segment, and may still run: a judge, a sandbox)."""
        keys = [(g.uid, j) for g in groups for j, p in enumerate(g.members or []) if p is not None and p.generated
                and not p.done]
        if not keys:
            return
        got = self.rollout.scores(keys)
        for g in groups:
            for j, p in enumerate(g.members or []):
                if (g.uid, j) in got:
                    p.sample.reward, p.sample.env_error = got[(g.uid, j)]
                    p.done = True
        missing = [key for key in keys if key not in got]
        if missing:
            raise RuntimeError(f"the rollout side holds no reward for the samples {missing[:5]} (group uid, index): "
                               "a bug in the in-flight rollouts")

    def _add(self, segment: StepRollout) -> None:
        c = self._counters
        c["seconds"] += segment.rollout_s
        c["tokens"] += segment.engine_counters[0]
        c["engine_s"] += segment.engine_counters[1]
        c["segments"] += 1

    def _admit(self, step: int) -> None:
        """Draw whole loader batches until `target` groups are in flight (the same number of batches on every
        rank: the loader's position is global). Collective."""
        deficit, = all_reduce_max_many([float(self.target - len(self.groups))], self.ctx.device)
        batches = max(0, math.ceil(deficit / self.per_step))
        world = self.ctx.world_size
        for _ in range(batches):
            rows = self.loader.next_batch()
            for i, (row, index) in enumerate(zip(rows, self.loader.last_indices)):
                uid = self.admitted_rows + self.ctx.rank + i * world
                seeds = [sample_seed(self.seed, 0, uid * self.n + j) for j in range(self.n)]
                self.groups.append(Group(uid, row, index, seeds, admitted=step))
            self.admitted_rows += len(rows) * world

    # -- the staleness bound ---------------------------------------------------------------
    def _over_stale(self, sample: Sample, trainer_version: int) -> bool:
        oldest = sample.oldest_version()
        return oldest is not None and trainer_version - oldest > self.k

    def _requeue_or_flag(self, groups: list[Group], trainer_version: int) -> None:
        """Samples that, trained at the earliest with the weights `trainer_version`, would be older than the bound:
        started again from the prompt (requeue) or marked to be trained past it (finish); counted either way."""
        for group in groups:
            for j, p in enumerate(group.members or []):
                if p is None or p.over_stale:
                    continue
                if self._over_stale(p.sample, trainer_version):
                    self._count_over_stale(len(p.sample.ids) - p.sample.prompt_length)
                    if self.requeue:
                        group.members[j] = None  # started again at the next segment, with a new seed
                        group.seeds[j] = sample_seed(group.seeds[j], 1, group.uid * self.n + j)
                        group.requeued += 1
                    else:
                        p.over_stale = True

    def _take_over_stale(self, trainer_version: int) -> None:
        """Done groups waiting to be trained may have grown too old while they waited (requeue: their old samples
        go back in flight; finish: they are trained anyway, counted)."""
        self._requeue_or_flag([g for g in self.groups if g.generated], trainer_version)

    def _count_over_stale(self, tokens: int) -> None:
        self._counters["over_stale"] += 1
        self._counters["over_stale_lengths"].append(tokens)

    # -- metrics ---------------------------------------------------------------------------
    @staticmethod
    def _fresh_counters() -> dict:
        return {"seconds": 0.0, "tokens": 0.0, "engine_s": 0.0, "segments": 0, "over_stale": 0,
                "over_stale_lengths": []}

    def _staleness_metrics(self, samples: list[Sample], trainer_version: int) -> dict[str, float]:
        return {}  # (in _inflight_metrics, per token version)

    def _inflight_metrics(self, step: int, samples: list[Sample], trainer_version: int) -> dict[str, float]:
        """Staleness per sample (its oldest token), the versions a sample spans, segments run, groups in flight,
        and the samples past the bound (all ranks)."""
        used = [s for s in samples if s.oldest_version() is not None]
        lags = [trainer_version - s.oldest_version() for s in used]
        spans = [max(v for v in s.token_versions if v >= 0) - min(v for v in s.token_versions if v >= 0) + 1
                 for s in used if any(v >= 0 for v in s.token_versions)]
        c = self._counters
        worst, widest = all_reduce_max_many([float(max(lags, default=0)), float(max(spans, default=0))],
                                            self.ctx.device)
        total_lag, count, total_span, spanning, over, over_tokens, in_flight = all_reduce_sum(
            [float(sum(lags)), float(len(lags)), float(sum(spans)), float(sum(s > 1 for s in spans)),
             float(c["over_stale"]), float(sum(c["over_stale_lengths"])), float(len(self.groups))], self.ctx.device)
        if worst > self.k and self.requeue:
            raise RuntimeError(f"step {step}: a sample is {worst:.0f} weight versions old, past rollout.max_staleness="
                               f"{self.k} with rollout.over_stale=requeue (a bug in the in-flight rollouts)")
        if over:
            self.report.log.event("over_stale", step, {"samples": int(over), "policy": self.settings.over_stale,
                                                       "tokens": c["over_stale_lengths"], "rank": self.ctx.rank})
        return {"async/staleness_mean": total_lag / max(count, 1.0), "async/staleness_max": worst,
                "async/version_span_mean": total_span / max(count, 1.0), "async/version_span_max": widest,
                "async/spanning_share": spanning / max(count, 1.0),
                "async/over_stale_share": over / max(count, 1.0),
                "async/over_stale_tokens_mean": over_tokens / over if over else 0.0,
                "async/segments": float(c["segments"]), "async/inflight_groups": in_flight}

    def _drain(self, metrics: dict[str, float], generation_only: bool = False) -> float:
        with self.watchdog.phase("rollout drain"):
            wait = self.prefetch.wait_generated() if generation_only else self.prefetch.drain()
        metrics["async/trainer_wait_s"] = metrics.get("async/trainer_wait_s", 0.0) + wait
        return wait

    # -- checkpoints -----------------------------------------------------------------------
    def inflight_state(self) -> tuple[dict, dict]:
        """(what every rank shares, this rank's groups): a checkpoint's `inflight` entries. Drains the segment in
        flight first (its rewards)."""
        if self.prefetch.in_flight:
            self.prefetch.drain()
            done = self.prefetch.take(self.prefetch.last_finished().step)
            self._add(done)  # trained on at the next step: its time counts there (after a resume: not at all)
        self._collect_scores(self.groups)  # a checkpoint holds no reward call in flight
        shared = {"world_size": self.ctx.world_size, "admitted_rows": self.admitted_rows,
                  "groups": int(all_reduce_sum([float(len(self.groups))], self.ctx.device)[0])}
        return shared, {"groups": self.groups}

    def resume_inflight(self, shared: dict, mine: dict | None, read_rank: Callable[[int], dict | None]) -> None:
        """Take over a checkpoint's groups in flight: this rank's own (same world size), else those of the saving
        ranks r with r mod world == this rank (`read_rank(r)`: that rank's saved entry)."""
        self.admitted_rows = int(shared["admitted_rows"])
        if shared["world_size"] == self.ctx.world_size and mine is not None:
            self.groups = list(mine["groups"])
            return
        groups = []
        for r in range(self.ctx.rank, int(shared["world_size"]), self.ctx.world_size):
            saved = read_rank(r)
            if saved is None:
                raise CheckpointError(f"trainer.load_ckpt_from: the checkpoint's rank{r}.pt holds no groups in flight "
                                      "(a damaged checkpoint: resume from an earlier one)")
            groups += saved["groups"]
        self.groups = sorted(groups, key=lambda g: g.uid)


def longest_sample(max_new_tokens: int, settings: RolloutConfig) -> int:
    """The most tokens one sample can sample: every turn to max_new_tokens (capped by the context, when known)."""
    longest = max_new_tokens * settings.max_turns
    return min(longest, settings.max_total_length) if settings.max_total_length else longest


def default_segment_tokens(max_new_tokens: int, settings: RolloutConfig) -> int:
    """rollout.segment_tokens=null: the longest sample fits max_staleness segments, the most a sample may span
    within the bound, so none has to be requeued only for being long."""
    return max(1, math.ceil(longest_sample(max_new_tokens, settings) / settings.max_staleness))


def read_saved_rank(path: str) -> Callable[[int], dict | None]:
    """A reader of the `inflight` entry of rank r's file in the checkpoint folder `path`."""
    def read(rank: int) -> dict | None:
        file = os.path.join(path, f"rank{rank}.pt")
        if not os.path.exists(file):
            return None
        return torch.load(file, weights_only=False).get("inflight")
    return read
