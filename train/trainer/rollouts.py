"""Where a step's samples come from, behind one interface (`RolloutSource`):

- `RolloutSource`: synchronous. Each step rolls out its prompts now, with the weights of the step
  before; `rollout.dynamic_sampling` (DAPO) draws more prompts until enough groups are informative.
- `PrefetchedRollouts` (`rollout.max_staleness=k`, k >= 1): step N+k's rollout runs on a background
  thread while step N trains (train/trainer/prefetch.py); this step's rollout was made earlier.

Both serve dedicated rollout ranks too (`rollout.ranks`): the engine and rollout worker they are given
then forward to a rollout rank. The trainer's step calls, in this order: `next` (this step's samples,
with the rollout's metrics), `hand_over` (the engine is the update's now), `before_push` (the samples
being generated must keep the weights they started with) and, at an evaluation or the run's end,
`settle` (nothing left in flight). Every collective runs on the main thread, in the same order on
every rank.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from train.datasets.config import DataConfig
from train.datasets.curriculum import Curriculum
from train.datasets.dataloader import RLDataLoader
from train.engines.base import SamplingParams
from train.parallel.collectives import all_gather_flat, all_reduce_max_many, all_reduce_sum
from train.parallel.distributed import DistContext
from train.runtime.checkpoint import CheckpointError
from train.runtime.watchdog import Watchdog
from train.trainer.engine_sleep import EngineSleep
from train.trainer.prefetch import RolloutPrefetcher, StepRollout, staleness
from train.trainer.replay import ReplayBuffer
from train.trainer.report import RunReport
from train.trainer.step import mask_truncated, rollout_metrics, select_groups, shape_rewards
from train.algorithms.dynamic_sampling import split_quota
from train.workers.config import RolloutConfig
from train.workers.rollout import PROMPT_TOO_LONG, Sample, sample_seed


@dataclass
class StepSamples:
    """One step's rollout, ready for the update."""
    samples: list[Sample]  # every sample rolled out for the step (all rounds)
    kept: list[Sample]  # the informative groups' samples, trimmed to the step's quota
    metrics: dict[str, float]  # the rollout's (global) metrics


class RolloutSource:
    """Synchronous rollouts: each step's made when the step asks for it."""

    def __init__(self, settings: RolloutConfig, data: DataConfig, ctx: DistContext, *, loader: RLDataLoader,
                 rollout, engine, sampling: SamplingParams, seed: int, curriculum: Curriculum, report: RunReport,
                 sources: list[str], engine_sleep: EngineSleep | None = None) -> None:
        self.settings, self.data, self.ctx = settings, data, ctx
        self.loader, self.rollout, self.engine = loader, rollout, engine
        self.engine_sleep = engine_sleep  # rollout.sleep (train/trainer/engine_sleep.py); None: always
        self.sampling, self.seed = sampling, seed
        self.curriculum, self.report, self.sources = curriculum, report, sources
        self.criteria: set[str] = set()  # rubric criteria every rank knows (step.rubric_metrics)
        replay = data.replay  # past groups mixed into later steps (data.replay.*)
        self.replay = (ReplayBuffer(replay, data.responses_per_prompt, data.curriculum.pass_threshold,
                                    data.prompts_per_rollout // ctx.world_size, seed, ctx.rank)
                       if replay.enable else None)

    # -- the step's calls ------------------------------------------------------------------
    def next(self, step: int, trainer_version: int) -> StepSamples:
        """This step's samples and the rollout's metrics (`trainer_version`: the step whose update made
        the actor's weights, for the staleness metrics)."""
        start = time.perf_counter()
        self.engine.wake()  # a no-op on CPU and where it stayed awake; SGLang takes its GPU memory back
        woke = time.perf_counter() - start
        got = self.collect(step, self.make(step), trainer_version)
        got.metrics["time/engine_wake_s"] = woke
        return got

    def hand_over(self, step: int, metrics: dict[str, float], tokens: int) -> None:
        """The rollout is over (this rank keeps `tokens` of it to train on): free the engine's accelerator
        memory for the update where the update needs it (rollout.sleep; a no-op on CPU)."""
        sleep, line = self.engine_sleep.decide(tokens) if self.engine_sleep is not None else (True, None)
        if line is not None:
            self.report.note(step, "engine_sleep", line)
        if sleep:
            start = time.perf_counter()
            self.engine.sleep()
            metrics["time/engine_sleep_s"] = time.perf_counter() - start
            held = getattr(self.engine, "host_bytes", 0)
            if held:  # the hf engine on a GPU: its weights in page-locked host memory (this rank's)
                metrics["memory/engine_host_gib"] = held / 2**30
        metrics["engine/slept"] = float(sleep)

    def before_push(self, metrics: dict[str, float]) -> float:
        """Before a weight push: the seconds waited for a rollout still generating (none here)."""
        return 0.0

    def after_push(self) -> None:
        """After the weight push (or the update that pushed nothing): generation may go on (rollout.inflight)."""

    def settle(self, metrics: dict[str, float]) -> float:
        """Before an evaluation or the run's end: the seconds waited for a rollout in flight (none here)."""
        return 0.0

    # -- checkpoints -----------------------------------------------------------------------
    def pending(self) -> list[StepRollout]:
        """Finished rollouts not yet trained on (what a checkpoint keeps)."""
        return []

    def restore(self, rollouts: list[StepRollout]) -> bool:
        """Take over rollouts a checkpoint kept; whether they were taken (a synchronous run rolls their
        prompts out again)."""
        return False

    def inflight_state(self) -> tuple[dict, dict] | None:
        """Rollouts in flight that a checkpoint keeps (rollout.inflight): (what every rank shares, this rank's);
        None here."""
        return None

    def resume_inflight(self, shared: dict, mine: dict | None, read_rank: Callable[[int], dict | None]) -> None:
        """Take over a checkpoint's rollouts in flight (rollout.inflight); a source without them cannot."""
        raise CheckpointError(f"trainer.load_ckpt_from: the checkpoint holds {shared.get('groups', 'some')} groups in "
                              "flight (saved with rollout.inflight=true); resume with rollout.inflight=true, or their "
                              "prompts would be lost")

    def close(self, wait_s: float = 60.0) -> None:
        """Stop making rollouts; the rollout worker (its event loop, env clients, engine) closes when
        nothing is left running (a rollout still running holds the worker's loop: the process ends with it).
        A rollout in flight gets `wait_s` seconds to end (0 when the run failed: its error line should not wait
        for a stuck env call)."""
        if self._idle(wait_s):
            self.rollout.close()

    def api_calls(self) -> list[dict]:
        """External calls the environments made since the last call (for the step's latency statistics)."""
        return self.rollout.pop_api_calls()

    def _idle(self, wait_s: float) -> bool:
        """Whether nothing is left running once this source stops (waiting at most `wait_s` seconds)."""
        return True

    # -- making rollouts -------------------------------------------------------------------
    def make(self, step: int, round_: int = 0, on_generated: Callable[[], None] | None = None) -> StepRollout:
        """One rollout of this rank's next prompts. No collective: with rollout.max_staleness >= 1 it runs
        on the prefetch thread while the main thread trains (`on_generated`: see RolloutWorker.rollout)."""
        loader_before = self.loader.state_dict()
        rows = self.loader.next_batch()
        n = self.data.responses_per_prompt
        # round 0 keeps the seeds of a plain step; refills draw fresh ones
        seed = sample_seed(self.seed, step, (round_ * self.ctx.world_size + self.ctx.rank) * len(rows) * n)
        before = self._engine_counters()
        samples, rollout_s = self.rollout.rollout(rows, n, self.sampling, seed, what=f"step {step}'s rollout",
                                                  on_generated=on_generated)
        counters = tuple(a - b for a, b in zip(self._engine_counters(), before))
        shape_rewards(samples, self.settings)
        return StepRollout(step, samples, rollout_s, counters, loader_before, list(self.loader.last_indices))

    def collect(self, step: int, first: StepRollout, trainer_version: int) -> StepSamples:
        """A step's samples, starting from `first` (its rollout, made now or prefetched), and the
        rollout's metrics.

        With `rollout.dynamic_sampling` (DAPO), new prompts are drawn and rolled out until the kept
        (informative) groups of all ranks reach `prompts_per_rollout`, at most
        `rollout.dynamic_sampling_max_rounds` rounds; the surplus is trimmed evenly across ranks. Each
        decision uses all-reduced counts, so every rank runs the same number of rounds."""
        settings, ctx = self.settings, self.ctx
        n = self.data.responses_per_prompt
        dynamic = settings.dynamic_sampling
        target = self.data.prompts_per_rollout
        all_samples, kept = [], []
        rollout_s, rounds, counters = 0.0, 0, [0.0, 0.0]
        max_rounds = settings.dynamic_sampling_max_rounds if dynamic else 1
        pass_rates: list[tuple[int, float]] = []  # (row index, share of its group that passed)
        threshold = self.data.curriculum.pass_threshold
        while rounds < max_rounds:
            got = first if rounds == 0 else self.make(step, rounds)
            samples = got.samples
            pass_rates += [(pid, sum(s.reward >= threshold for s in samples[g * n:(g + 1) * n]) / n
                            if samples[g * n].finish_reason != PROMPT_TOO_LONG else float("nan"))  # not rolled out
                           for g, pid in enumerate(got.row_indices)]
            rounds += 1
            rollout_s += got.rollout_s
            counters = [a + b for a, b in zip(counters, got.engine_counters)]
            all_samples += samples
            kept += select_groups(samples, n, settings.dynamic_filtering or dynamic)
            if not dynamic:
                break
            counts = [0.0] * ctx.world_size
            counts[ctx.rank] = float(len(kept) // n)
            counts = [int(c) for c in all_reduce_sum(counts, ctx.device)]
            if sum(counts) >= target:
                break
        out = rollout_metrics(all_samples, len(all_samples) // n, n, settings, ctx,
                              rewards=[s.shaped_reward for s in all_samples], sources=self.sources,
                              known_criteria=self.criteria)
        if out["prompt_overflow_ratio/train"] > 0:  # (all-reduced: every rank takes this branch)
            self.report.prompt_overflows_at(step, all_samples, n)
        out["time/rollout_s"] = rollout_s
        out.update(self._engine_metrics(step, counters))
        out.update(self._staleness_metrics(all_samples, trainer_version))
        out.update(self._record_pass_rates(step, pass_rates))
        if settings.overlong_buffer:
            total, count = all_reduce_sum([sum(s.overlong_penalty for s in all_samples), float(len(all_samples))],
                                          ctx.device)
            out["rewards/overlong_penalty"] = total / max(count, 1.0)
        if dynamic:
            quota = split_quota(counts, target)[ctx.rank]
            kept = kept[: quota * n]
            out["dynamic_sampling/rounds"] = float(rounds)
            out["dynamic_sampling/groups"] = float(min(sum(counts), target))
            if sum(counts) < target:
                self.report.log.event("dynamic_sampling.short", step, {"rounds": rounds, "groups": sum(counts),
                                                                       "target": target})
        if settings.mask_truncated:
            mask_truncated(kept)
        if self.replay is not None:
            kept = self._mix_replay(step, kept, out)
        return StepSamples(all_samples, kept, out)

    def _mix_replay(self, step: int, kept: list[Sample], out: dict[str, float]) -> list[Sample]:
        """The step's fresh groups and those replayed (data.replay), with the replay's global metrics."""
        fresh = float(len(kept) // self.data.responses_per_prompt)
        kept, drawn = self.replay.mix(step, kept)
        groups, reward, age, held, favoured, fresh = all_reduce_sum([*self.replay.local_sums(step, drawn), fresh],
                                                                    self.ctx.device)
        out["replay/groups"] = groups
        out["replay/share"] = groups / max(groups + fresh, 1.0)
        out["replay/buffer_groups"] = held
        if groups:
            out["replay/reward"] = reward / (groups * self.data.responses_per_prompt)
            out["replay/age"] = age / groups  # steps since the replayed groups were rolled out
            if self.replay.favoured:  # adaptive replay: the share drawn from sources the forgetting gate flagged
                out["replay/favoured_share"] = favoured / groups
        return kept

    # -- the rollout's metrics -------------------------------------------------------------
    def _engine_counters(self) -> tuple[float, float]:
        """The engine's running (generated tokens, generation seconds)."""
        return float(self.engine.stats["generated_tokens"]), float(self.engine.stats["generation_seconds"])

    def _engine_metrics(self, step: int, counters: list[float]) -> dict[str, float]:
        """Decode throughput of this step's rollout (`counters`: its engine tokens and seconds), summed
        over ranks (engines that count it), the env calls stuck past their timeout, and the CUDA graphs the
        engines captured so far (the hf engine's static path: they grow at every step where it slept)."""
        graphs = float(getattr(self.engine, "stats", {}).get("cuda_graphs", 0))
        tokens, seconds, stuck, graphs = all_reduce_sum([*counters, float(self.rollout.stuck_calls), graphs],
                                                        self.ctx.device)
        self.report.stuck_calls(step, stuck)
        return {"rollout/tokens": tokens, "rollout/tokens_per_s": tokens / max(seconds / self.ctx.world_size, 1e-9),
                "env/stuck_calls": stuck, "engine/cuda_graphs": graphs}

    def _staleness_metrics(self, samples: list[Sample], trainer_version: int) -> dict[str, float]:
        """How many weight versions behind the trainer's each sample's oldest turn was (all ranks);
        nothing for synchronous rollouts (always 0)."""
        return {}

    def _record_pass_rates(self, step: int, pass_rates: list[tuple[int, float]]) -> dict[str, float]:
        """Every rank's group pass rates into the (global) prompt statistics: one all-gather of two
        floats per group (every rank has as many groups: equal batches, equal rounds)."""
        mine = torch.tensor([v for pair in pass_rates for v in pair], dtype=torch.float64, device=self.ctx.device)
        every = torch.empty(mine.numel() * self.ctx.world_size, dtype=torch.float64, device=self.ctx.device)
        if self.ctx.world_size > 1:
            all_gather_flat(every, mine)
        else:
            every = mine
        values = every.view(-1, 2).tolist()
        self.curriculum.record(step, [(self.curriculum.id_of(int(i)), rate) for i, rate in values
                                      if rate == rate])  # NaN: a row skipped for its prompt's length
        return self.curriculum.take_counters()


class PrefetchedRollouts(RolloutSource):
    """`rollout.max_staleness=k`: while step N trains, step N+k's rollout runs in the background with
    the weights of step N-1; steps N+1 .. N+k-1's are finished and queued (train/trainer/prefetch.py)."""

    def __init__(self, settings: RolloutConfig, data: DataConfig, ctx: DistContext, *, total_steps: int,
                 watchdog: Watchdog, **parts) -> None:
        super().__init__(settings, data, ctx, **parts)
        self.total_steps, self.watchdog = total_steps, watchdog
        self.k = settings.max_staleness
        self.prefetch = RolloutPrefetcher(lambda step, generated: self.make(step, on_generated=generated),
                                          settings.async_timeout_s)

    def next(self, step: int, trainer_version: int) -> StepSamples:
        self.engine.wake()
        waited: dict[str, float] = {}
        if self.prefetch.in_flight and self.prefetch.queued() == [step]:
            self._drain(waited)  # this step's rollout: generated before the last push, rewards maybe not yet
        first = self.prefetch.take(step)
        got = self.collect(step, first or self.make(step), trainer_version)
        got.metrics.update(waited)
        return got

    def hand_over(self, step: int, metrics: dict[str, float], tokens: int) -> None:
        """Queue the rollouts up to step+k (the last one generating in the background while this step
        trains); after the last step, free the engine as a synchronous run does."""
        if step >= self.total_steps:
            self.engine.sleep()
            return
        if self.prefetch.in_flight:  # (k >= 2) the previous one may still be computing rewards
            self._drain(metrics)
        self._roll_ahead(step)

    def before_push(self, metrics: dict[str, float]) -> float:
        """The next step's samples all come from the weights before this update: wait until the rollout
        in flight has generated them (its rewards may go on)."""
        return self._drain(metrics, generation_only=True)

    def settle(self, metrics: dict[str, float]) -> float:
        """Evaluation uses the engine, and the run's end the rollout's results: wait for the one in flight."""
        return self._drain(metrics) if self.prefetch.in_flight else 0.0

    def pending(self) -> list[StepRollout]:
        return self.prefetch.pending()

    def restore(self, rollouts: list[StepRollout]) -> bool:
        self.prefetch.restore(with_rewards_on_samples(rollouts))  # trained as they were generated: bit-exact
        return True

    def _idle(self, wait_s: float) -> bool:
        return self.prefetch.close(wait_s)

    def _roll_ahead(self, step: int) -> None:
        """Queue the rollouts of steps step+1 .. step+k: those missing below step+k (the first steps,
        or a resume that kept none) are made now, with the current weights; step+k's starts in the
        background, with the weights of step - 1, while this step trains."""
        last = min(step + self.k, self.total_steps)
        queued = set(self.prefetch.queued())
        missing = [s for s in range(step + 1, last) if s not in queued]
        if missing:
            self.prefetch.restore(self.prefetch.pending() + [self.make(s) for s in missing])
        if last not in queued:
            self.prefetch.start(last)

    def _drain(self, metrics: dict[str, float], generation_only: bool = False) -> float:
        """Wait for the prefetched rollout (`generation_only`: until it no longer uses the engine, before
        a push); log how long each side waited for the other."""
        with self.watchdog.phase("rollout drain"):
            start = time.monotonic()
            wait = self.prefetch.wait_generated() if generation_only else self.prefetch.drain()
            done = None if generation_only else self.prefetch.last_finished()
        metrics["async/trainer_wait_s"] = metrics.get("async/trainer_wait_s", 0.0) + wait
        if done is not None:  # the rollout side sat idle from its end until now
            metrics["async/rollout_idle_s"] = max(0.0, start - done.finished_at)
        return wait

    def _staleness_metrics(self, samples: list[Sample], trainer_version: int) -> dict[str, float]:
        lags = staleness([s.turn_versions for s in samples], trainer_version)
        worst, = all_reduce_max_many([float(max(lags, default=0))], self.ctx.device)
        total, count = all_reduce_sum([float(sum(lags)), float(len(lags))], self.ctx.device)
        if worst > self.k:
            raise RuntimeError(f"a sample is {worst:.0f} weight versions old, past rollout.max_staleness="
                               f"{self.k} (a bug in the rollout pipeline)")
        return {"async/staleness_mean": total / max(count, 1.0), "async/staleness_max": worst}


def with_rewards_on_samples(rollouts: list[StepRollout]) -> list[StepRollout]:
    """Rollouts from a checkpoint saved before each sample carried its shaped reward (the rollout held
    them in two parallel lists then): the rewards and penalties moved onto the samples."""
    for r in rollouts:
        rewards, penalties = r.__dict__.pop("rewards", None), r.__dict__.pop("penalties", None)
        if rewards is not None:
            for s, reward, penalty in zip(r.samples, rewards, penalties):
                s.shaped_reward, s.overlong_penalty = reward, penalty
    return rollouts
