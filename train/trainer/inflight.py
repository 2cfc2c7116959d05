"""In-flight rollouts (`rollout.inflight=true`): sequences keep generating across weight updates.

About `rollout.inflight_groups` groups (prompts with their `responses_per_prompt` samples; default max_staleness x
prompts_per_rollout) are in flight. The rollout side works in **segments**: in one segment every unfinished
sample samples at most `rollout.segment_tokens` more tokens, its env turns included; its reward starts the moment
its last turn is over and runs past the segment. A step trains the first `prompts_per_rollout` groups, in
admission order, that are generated; the others go on in later segments, with the weights of later pushes. So a
long reply no longer holds the step back, and the weights change under sequences that are still generating.

A segment samples with one weight version, and every token keeps the version and the log-prob it was sampled with
(`Sample.token_versions`), so the loss corrects each token against its own sampler (actor.tis_cap). At the next
segment the earlier tokens are prefilled again with the new weights (their KV cache is recomputed, not kept): the
later tokens are exactly the new policy's samples given the prefix.

Two paces (`rollout.inflight_mode`):

- `InflightRollouts`, lockstep: one segment per step, in the background during the update (weights of the step
  before), and the push waits for it to pause (at most segment_tokens per sequence, never the longest reply):

      step N:  take the generated groups -> segment N+1 starts (weights N-1) -> update N -> segment N+1 pauses
               -> push (weights N: segment N+2 samples with them)

  Deterministic: segments end by token counts, never by time, and every sample has its own request seed (a turn
  paused and resumed continues its stream of uniforms), so which tokens each version sampled never depends on
  thread timing, and a resume from a checkpoint trains on exactly the samples of a straight run.
- `ContinuousRollouts`: segments back to back on a thread of their own; a sample pauses at each env call, which
  runs on past the segment, so a push waits for generation only. Faster with a slow environment, not
  deterministic.

A checkpoint holds every group in flight (tokens, versions, log-probs, the conversation, which is the env's whole
state; rewards in flight are collected first) and the count of rows admitted; on another world size the saving
ranks' groups are dealt to the new ranks (old rank r's to new rank r mod world): none lost, none twice.

The staleness bound (`rollout.max_staleness=k`, per sample): trained at step T, whose weights are T-1's, a sample's
oldest token is at most k versions old. Before each segment, and when a group is taken, a sample whose oldest
token would be older is either started again from its prompt with the newest weights (`rollout.over_stale=requeue`:
the bound holds strictly) or trained past the bound (`finish`); its group is kept either way, and the share and
lengths of such samples are logged (`async/over_stale_share`, `async/over_stale_tokens_mean`, an `over_stale`
event with every length), so a bias towards short replies is not hidden. Admission never draws more prompts than
keep `inflight_groups` in flight, which keeps the queue of generated groups short and within the bound.
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable

import torch

from train.datasets.config import DataConfig
from train.parallel.collectives import all_reduce_max_many, all_reduce_sum
from train.parallel.distributed import DistContext
from train.runtime.checkpoint import CheckpointError
from train.runtime.watchdog import Watchdog
from train.trainer.prefetch import RolloutPrefetcher, RolloutTimeout, StepRollout
from train.trainer.rollouts import RolloutSource, StepSamples
from train.trainer.step import select_groups, shape_rewards
from train.workers.config import RolloutConfig, longest_sample
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
        dropped: list[Group] = []  # rollout.dynamic_sampling: generated groups without signal, not trained
        for _ in range(MAX_SEGMENTS_PER_STEP):
            self._take_over_stale(trainer_version)
            if self.settings.dynamic_sampling:
                dropped += self._drop_uninformative()
            ready = sum(g.generated for g in self.groups)
            fewest, = all_reduce_max_many([-float(ready)], self.ctx.device)
            if -fewest >= self.per_step:  # every rank has a step's worth (collective: all ranks decide alike)
                break
            self._admit()
            self._add(self._segment(step, trainer_version))
        else:
            raise RuntimeError(f"step {step}: {MAX_SEGMENTS_PER_STEP} segments and still not {self.per_step} groups "
                               "done: with rollout.over_stale=requeue samples too long for rollout.max_staleness x "
                               "rollout.segment_tokens tokens start again forever (raise either, or over_stale=finish)")
        taken = [g for g in self.groups if g.generated][: self.per_step]
        self.groups = [g for g in self.groups if not any(g is t for t in taken)]
        self._collect_scores(taken)
        return self._hand_out(step, trainer_version, taken, dropped, waited)

    def _hand_out(self, step: int, trainer_version: int, taken: list[Group], dropped: list[Group],
                  waited: dict[str, float]) -> StepSamples:
        """The step's samples (the groups taken, scored), with the rollout's metrics."""
        c, self._counters = self._counters, self._fresh_counters()
        samples = []
        for i, group in enumerate(taken + dropped):  # (collect's filter drops the dropped ones again, counted)
            for p in group.members:
                p.sample.group, p.sample.uid = i, group.uid
                samples.append(p.sample)
        shape_rewards(samples, self.settings)
        rollout = StepRollout(step, samples, c["seconds"], (c["tokens"], c["engine_s"]), self.loader.state_dict(),
                              [g.row_index for g in taken + dropped])
        got = self.collect(step, rollout, trainer_version)
        got.metrics.update(waited)
        got.metrics.update(self._inflight_metrics(step, samples, trainer_version, c))
        return got

    def hand_over(self, step: int, metrics: dict[str, float], tokens: int) -> None:
        """Admit prompts up to `inflight_groups` and start the next segment in the background (with the weights
        the update starts from); after the last step, free the engine as a synchronous run does."""
        if step >= self.total_steps:
            self.engine.sleep()
            return
        self._admit()
        self.prefetch.start(step + 1)

    def before_push(self, metrics: dict[str, float]) -> float:
        """The segment in flight samples with the weights it started with: wait until it is paused (at most
        `segment_tokens` per sequence; rewards may go on)."""
        if not self.prefetch.in_flight:
            return 0.0
        return self._drain(metrics, generation_only=True)

    def settle(self, metrics: dict[str, float]) -> float:
        return self._drain(metrics) if self.prefetch.in_flight else 0.0

    def _idle(self, wait_s: float) -> bool:
        return self.prefetch.close(wait_s)

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
        self._merge(got)
        counters = tuple(a - b for a, b in zip(self._engine_counters(), before))
        return StepRollout(step, [], seconds, counters, {})

    def _merge(self, got: list[Group]) -> None:
        """Groups back from a segment (the same objects, or a rollout rank's copies) in their places, with the
        rewards that came in meanwhile for samples generated earlier (onto those generated and not scored)."""
        fresh = {g.uid: g for g in got}
        self.groups = [fresh.get(g.uid, g) for g in self.groups]
        self._apply_scores(self.groups, self.rollout.finished_scores())

    @staticmethod
    def _apply_scores(groups: list[Group], scores: dict[tuple[int, int], tuple[float, str | None]]) -> None:
        """(reward, env error) by (group uid, sample index) onto the generated samples not scored yet (a requeued
        sample's old reward finds its sample not generated and is ignored)."""
        for g in groups:
            for j, p in enumerate(g.members or []):
                if p is not None and p.generated and not p.done and (g.uid, j) in scores:
                    p.sample.reward, p.sample.env_error = scores[(g.uid, j)]
                    p.done = True

    def _drop_uninformative(self, scored_only: bool = False, among: list[Group] | None = None) -> list[Group]:
        """rollout.dynamic_sampling: the generated groups whose shaped rewards are all equal (or whose prompt could
        not be used) leave the pool: a step counts only informative groups as ready, and segments go on until
        every rank has its share (DAPO's refill, without rounds: the next prompts are already in flight).
        `scored_only`: only groups whose rewards are in (no waiting for the others)."""
        generated = [g for g in (self.groups if among is None else among) if (g.done if scored_only else g.generated)]
        self._collect_scores(generated)
        out = []
        for g in generated:
            samples = [p.sample for p in g.members]
            shape_rewards(samples, self.settings)
            if not select_groups(samples, self.n, True):
                out.append(g)
        self.groups = [g for g in self.groups if not any(g is o for o in out)]
        return out

    def _collect_scores(self, groups: list[Group]) -> None:
        """The rewards of the generated samples of `groups` not scored yet (their reward calls started when they
        were generated, in an earlier segment, and may still run: a judge, a sandbox)."""
        keys = [(g.uid, j) for g in groups for j, p in enumerate(g.members or []) if p is not None and p.generated
                and not p.done]
        if not keys:
            return
        got = self.rollout.scores(keys)
        self._apply_scores(groups, got)
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

    def _admit(self) -> None:
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
                self.groups.append(Group(uid, row, index, seeds))
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
                    else:
                        p.over_stale = True

    def _take_over_stale(self, trainer_version: int, among: list[Group] | None = None) -> None:
        """Done groups waiting to be trained may have grown too old while they waited (requeue: their old samples
        go back in flight; finish: they are trained anyway, counted). `among`: these groups only."""
        self._requeue_or_flag([g for g in (self.groups if among is None else among) if g.generated], trainer_version)

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

    def _inflight_metrics(self, step: int, samples: list[Sample], trainer_version: int,
                          c: dict) -> dict[str, float]:
        """Staleness per sample (its oldest token), the versions a sample spans, segments run, groups in flight,
        and the samples past the bound (all ranks)."""
        oldest = [v for v in (s.oldest_version() for s in samples) if v is not None]
        lags = [trainer_version - v for v in oldest]
        sampled = [[v for v in s.token_versions if v >= 0] for s in samples]
        spans = [max(vs) - min(vs) + 1 for vs in sampled if vs]
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


class ContinuousRollouts(InflightRollouts):
    """`rollout.inflight_mode=continuous`: segments run back to back on a thread of their own while the trainer
    trains; a push (and an evaluation, a checkpoint) waits for the segment in flight, then the next ones sample
    with the new weights. A segment takes each sample at most `segment_tokens` tokens or to its next env call,
    which runs on past the segment (the next segment takes its reply), so no push waits for a tool. A step
    takes the first groups (admission order) that are generated and scored as soon as every rank has its share.
    Not deterministic: how many segments ran before a push depends on timing, so a resume continues every group
    in flight (none lost, none twice) but not on the same tokens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefetch.close()  # (the lockstep source's; segments run on this source's own thread)
        self._cond = threading.Condition()
        self._paused, self._running, self._stopping = True, False, False
        self._in_segment: set[int] = set()  # the uids of the groups the segment in flight holds
        self._failure: BaseException | None = None
        self._trainer_version = 0  # the trainer's weights as of the step in progress (the bound, before a segment)
        self._thread = threading.Thread(target=self._loop, name="rollout-continuous", daemon=True)
        self._thread.start()

    # -- the step's calls ------------------------------------------------------------------
    def next(self, step: int, trainer_version: int) -> StepSamples:
        self.engine.wake()
        self._trainer_version = trainer_version
        start = time.monotonic()
        self._resume()
        dropped: list[Group] = []
        while True:
            with self._cond:
                self._raise_failure()
                settled = self._settled()
                self._take_over_stale(trainer_version, settled)
                if self.settings.dynamic_sampling:
                    dropped += self._drop_uninformative(scored_only=True, among=settled)
                ready = sum(g.generated and g.done for g in self._settled())
            fewest, = all_reduce_max_many([-float(ready)], self.ctx.device)
            if -fewest >= self.per_step:
                break
            self._admit()  # (collective: every rank loops as often, each decision all-reduced)
            if time.monotonic() - start > self.settings.async_timeout_s:
                raise RolloutTimeout(f"the trainer waited {self.settings.async_timeout_s:.0f} s "
                                     f"(rollout.async_timeout_s) for step {step}'s {self.per_step} groups "
                                     f"({ready} generated and scored on rank {self.ctx.rank}): the engine or an env "
                                     "call is stuck (see the watchdog's stack dump if it fired)")
            with self._cond:
                self._cond.notify_all()
                self._cond.wait(timeout=0.5)  # until a segment ends
        with self._cond:
            taken = [g for g in self._settled() if g.generated and g.done][: self.per_step]
            self.groups = [g for g in self.groups if not any(g is t for t in taken)]
        return self._hand_out(step, trainer_version, taken, dropped,
                              {"async/trainer_wait_s": time.monotonic() - start})

    def hand_over(self, step: int, metrics: dict[str, float], tokens: int) -> None:
        if step >= self.total_steps:
            self._pause()
            self.engine.sleep()
            return
        self._admit()
        self._resume()

    def before_push(self, metrics: dict[str, float]) -> float:
        """The segment in flight ends with the weights it started with; none starts until `after_push`."""
        with self.watchdog.phase("rollout drain"):
            wait = self._pause()
        metrics["async/trainer_wait_s"] = metrics.get("async/trainer_wait_s", 0.0) + wait
        return wait

    def after_push(self) -> None:
        self._resume()

    def settle(self, metrics: dict[str, float]) -> float:
        return self._pause()

    def inflight_state(self) -> tuple[dict, dict]:
        self._pause()  # (resumed by the next step)
        return super().inflight_state()

    def _admit(self) -> None:
        with self._cond:
            super()._admit()
            self._cond.notify_all()

    def _idle(self, wait_s: float) -> bool:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=wait_s)
        return not self._thread.is_alive()

    # -- the segments' thread --------------------------------------------------------------
    def _pause(self) -> float:
        """Stop starting segments and wait for the one in flight; the seconds waited."""
        start = time.monotonic()
        with self._cond:
            self._paused = True
            while self._running:
                self._raise_failure()
                if time.monotonic() - start > self.settings.async_timeout_s:
                    raise RolloutTimeout(f"the trainer waited {self.settings.async_timeout_s:.0f} s "
                                         "(rollout.async_timeout_s) for the segment in flight to end; the engine or "
                                         "an env call is stuck")
                self._cond.wait(timeout=0.5)
            self._raise_failure()
        return time.monotonic() - start

    def _resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _settled(self) -> list[Group]:
        """The groups the segment in flight does not hold (the trainer may take, requeue or drop them)."""
        return [g for g in self.groups if g.uid not in self._in_segment]

    def _work(self) -> list[Group]:
        """The groups a segment takes on: those with samples to generate or env replies to take (the generated
        ones stay here; their rewards come back with the segments)."""
        return [g for g in self.groups if not g.generated]

    def _scoring(self) -> bool:
        return any(g.generated and not g.done for g in self.groups)

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and (self._paused or not (self._work() or self._scoring())):
                        self._cond.wait()
                    if self._stopping:
                        return
                    self._running = True
                    self._requeue_or_flag([g for g in self.groups if not g.generated], self._trainer_version)
                    groups = self._work()
                    self._in_segment = {g.uid for g in groups}
                try:
                    self._segment_of(groups)
                finally:
                    with self._cond:
                        self._running, self._in_segment = False, set()
                        self._cond.notify_all()
        except BaseException as e:  # the trainer raises it at its next wait
            with self._cond:
                self._failure = e
                self._cond.notify_all()

    def _segment_of(self, groups: list[Group]) -> None:
        before = self._engine_counters()
        # (a segment with nothing to generate waits for the first env reply or reward: no busy loop)
        got, seconds = self.rollout.advance(groups, self.sampling, self.budget, what="a segment", defer_env=True)
        counters = tuple(a - b for a, b in zip(self._engine_counters(), before))
        with self._cond:
            self._merge(got)
            self._add(StepRollout(0, [], seconds, counters, {}))


def default_segment_tokens(max_new_tokens: int, settings: RolloutConfig) -> int:
    """rollout.segment_tokens=null: the longest sample fits max_staleness segments, the most a sample may span
    within the bound, so none has to be requeued only for being long."""
    return max(1, math.ceil(longest_sample(settings, max_new_tokens) / settings.max_staleness))


def read_saved_rank(path: str) -> Callable[[int], dict | None]:
    """A reader of the `inflight` entry of rank r's file in the checkpoint folder `path`."""
    def read(rank: int) -> dict | None:
        file = os.path.join(path, f"rank{rank}.pt")
        if not os.path.exists(file):
            return None
        return torch.load(file, weights_only=False).get("inflight")
    return read
