"""What a run tells its user beyond the metrics: warnings, sampled conversations, env errors, and
why steps changed no weight. Rank 0 writes; every method that gathers is collective (called on
every rank in the same order)."""
from __future__ import annotations

from train.datasets.loading import DataError
from train.datasets.vision import loggable
from train.parallel.collectives import broadcast_from_main, gather_to_main
from train.parallel.distributed import DistContext
from train.runtime.logging import RunLogger
from train.trainer.data_check import PromptOverflowLog, overflowed_rows, overlong_error
from train.utils import api_stats
from train.workers.rollout import Sample

# The closing line's reason for each kind of step that changed no actor weight.
NO_UPDATE_CAUSES = {
    "env_errors": "every sample an env error (the env warning above, env/errors, env_error events in "
                  "trajectories.jsonl)",
    "skipped": "skipped: every group's rewards were identical, so dynamic filtering dropped them all "
               "(actor/skipped)",
    "rolled_back": "rolled back by the governor (the 'governor rolled back' lines above, governor/rollback)",
}
SKIPPED_HINT = ("every group's rewards were identical, so dynamic filtering dropped them all; look at rewards/train "
                "and at the samples in trajectories.jsonl (too hard, too easy, or a broken reward_fn?)")


class RunReport:
    """The run's warnings and logged samples, and the counts its closing line reports."""

    def __init__(self, log: RunLogger, ctx: DistContext, *, env_files: str | dict, env_name: str,
                 env_error_reward: float, log_samples: int, warn_skipped_steps: int | None, freeze_steps: int,
                 overlong_prompts: str, prompt_overflows: PromptOverflowLog) -> None:
        self.log, self.ctx = log, ctx
        self.env_files, self.env_name, self.env_error_reward = env_files, env_name, env_error_reward
        self.log_samples, self.warn_skipped_steps, self.freeze_steps = log_samples, warn_skipped_steps, freeze_steps
        self.overlong_prompts, self.prompt_overflows = overlong_prompts, prompt_overflows
        self.outcomes: dict[str, int] = {}  # why each step of this launch changed no actor weight (or "updated")
        self.skipped_in_a_row = self.updates = 0
        self._env_failing: set[str | None] = set()  # sources whose every sample failed, warned once per streak
        self._all_env_errors = False  # (rank 0) every sample of the last step was an env error
        self._warned_stuck = False

    def warn(self, step: int, warning: str) -> None:
        """A warning line on rank 0's output and a `warning` event in trajectories.jsonl."""
        self.log.write(f"warning: {warning}")
        self.log.event("warning", step, {"warning": warning})

    # -- the rollout -------------------------------------------------------------------------
    def note(self, step: int, kind: str, line: str) -> None:
        """A line on rank 0's output and a `kind` event in trajectories.jsonl."""
        self.log.write(line)
        self.log.event(kind, step, {"line": line})

    def stuck_calls(self, step: int, stuck: float) -> None:
        """Warn once per run when env calls are stuck past their timeout (`stuck`: all ranks' count)."""
        if stuck and not self._warned_stuck:
            self._warned_stuck = True
            self.warn(step, f"{stuck:.0f} sync env call(s) still running past rollout.env_timeout_s, each holding "
                            f"a thread (at most rollout.env_workers per rank are replaced; see env/stuck_calls): "
                            f"a reward_fn or interact in {self.env_name} that never returns?")

    def prompt_overflows_at(self, step: int, samples: list[Sample], group_size: int) -> None:
        """Rows whose prompt filled the context this step (their samples were skipped): a
        `prompt_too_long` event each and a counted warning on rank 0, or, with
        data.overlong_prompts=fail, the error on every rank. Collective."""
        gathered = gather_to_main(overflowed_rows(samples, group_size), self.ctx)
        error = None
        if gathered is not None:
            rows = [row for part in gathered for row in part]
            for row in [r for r in rows if r.get("type") == "bad_image"]:  # skipped whatever overlong_prompts says
                self.log.event("bad_image", step, row)
                self.warn(step, f"skipped a prompt: {row['error']}")
            rows = [r for r in rows if r.get("type") != "bad_image"]
            for row in rows:
                self.log.event("prompt_too_long", step, row)
            if self.overlong_prompts == "fail" and rows:
                error = overlong_error(rows[0].get("row"), rows[0]["tokens"], self.prompt_overflows.context)
            else:
                for line in self.prompt_overflows.add(rows):
                    self.warn(step, line)
        if self.overlong_prompts == "fail":
            error = broadcast_from_main(error, self.ctx)
            if error is not None:
                raise DataError(error)

    def samples(self, step: int, samples: list[Sample], api_calls: list) -> dict[str, float]:
        """Sampled conversations, env errors and external-call latencies (`api_calls`) to rank 0's logs;
        returns the latency metrics (on rank 0). Collective."""
        errors = [{"error": s.env_error, "source": s.source, "messages": loggable(s.messages)} for s in samples
                  if s.env_error]
        counts: dict[str | None, int] = {}  # samples per source, for the env error warning
        for s in samples:
            counts[s.source] = counts.get(s.source, 0) + 1
        shown = [{"messages": loggable(s.messages), "answer": s.answer, "source": s.source, "reward": s.reward,
                  "finish_reason": s.finish_reason,
                  "n_turns": s.n_turns, "turn_versions": s.turn_versions, "events": s.events,
                  **({"criteria": s.criteria} if getattr(s, "criteria", None) else {}),
                  **({"uid": s.uid, "versions": sorted({v for v in s.token_versions if v >= 0})}
                     if s.uid is not None else {})}
                 for s in samples[:self.log_samples]]
        gathered = gather_to_main({"errors": errors, "samples": shown, "calls": api_calls, "counts": counts}, self.ctx)
        if gathered is None:
            return {}
        self._env_errors(step, gathered)
        all_calls = []
        for rank, part in enumerate(gathered):
            for e in part["errors"]:
                self.log.event("env_error", step, {"rank": rank, **e})
            for s in part["samples"]:
                self.log.event("sample", step, {"rank": rank, **s})
            all_calls += part["calls"]
        stats = api_stats.summarize(all_calls)
        if stats:
            self.log.event("api_stats", step, {"stats": stats})
        errors = api_stats.errors_by_kind(all_calls)
        if errors:  # what failed, even when a retry then succeeded (the counts are in the stats)
            self.log.event("api_errors", step, {"errors": errors})
        return stats

    def _env_errors(self, step: int, gathered: list[dict]) -> None:
        """(rank 0) A warning when every sample of a source (or of the step, without sources) ended in an
        env error, naming the source, its env file and the first error; once per streak of such steps."""
        counts: dict[str | None, int] = {}
        failed: dict[str | None, list[str]] = {}
        for part in gathered:
            for source, n in part["counts"].items():
                counts[source] = counts.get(source, 0) + n
            for e in part["errors"]:
                failed.setdefault(e["source"], []).append(e["error"])
        self._all_env_errors = bool(counts) and sum(map(len, failed.values())) == sum(counts.values())
        for source, n in counts.items():
            if len(failed.get(source, ())) < n:
                self._env_failing.discard(source)  # the streak ends: warn again if it comes back
                continue
            if source in self._env_failing:
                continue
            self._env_failing.add(source)
            paths = self.env_files
            env = paths if isinstance(paths, str) else paths.get(source, self.env_name)
            first = failed[source][0]
            first = first if len(first) <= 300 else first[:300] + " ..."
            whose = f"the {n} samples from source '{source}'" if source is not None else f"its {n} samples"
            metric = f"env/errors/{source}" if source is not None else "env/errors"
            self.warn(step, f"step {step}: every one of {whose} ended in an env error in {env} (each scored "
                            f"rollout.env_error_reward={self.env_error_reward:g}); the first: {first}; "
                            f"see {metric} and the env_error events in trajectories.jsonl (warned again only after "
                            "a step where some succeed)")

    # -- the update --------------------------------------------------------------------------
    def skipped(self, step: int) -> None:
        """Say so when `trainer.warn_skipped_steps` steps in a row learned nothing (once per streak), and at
        once when this launch's first step did (a short run's closing line must have a warning to point at)."""
        self.skipped_in_a_row += 1
        limit = self.warn_skipped_steps
        if limit and limit > 1 and self.updates == 0 and self.skipped_in_a_row == 1:
            self.warn(step, f"step {step} made no update: {SKIPPED_HINT} (warned once; again after {limit} such "
                            "steps in a row, trainer.warn_skipped_steps)")
        if limit and self.skipped_in_a_row == limit:
            self.warn(step, f"no update in the last {limit} steps (up to step {step}): {SKIPPED_HINT}")

    def updated(self) -> None:
        self.skipped_in_a_row = 0
        self.updates += 1

    def weight_change(self, step: int, change: float, limit: float) -> None:
        """Without a governor, a warning when an update moved the actor's weight norm more than `limit`."""
        if change > limit:
            self.warn(step, f"step {step}'s update changed the actor's weight norm by {100 * change:.3g}% "
                            f"(> trainer.governor.max_weight_change={limit:g}): actor.lr too high? "
                            "trainer.governor.enable=true rolls such updates back")

    def outcome(self, metrics: dict[str, float]) -> None:
        """Count why this step changed no actor weight, or that it did (the run's closing line)."""
        if self._all_env_errors:  # (known on rank 0, the one that prints)
            outcome = "env_errors"
        elif metrics.get("actor/skipped"):
            outcome = "skipped"
        elif metrics.get("governor/rollback"):
            outcome = "rolled_back"
        elif metrics.get("actor/frozen"):
            outcome = "frozen"
        else:
            outcome = "updated"
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def closing(self, steps: int) -> None:
        """The closing warning of a run that learned nothing (a run frozen throughout, actor.freeze_steps,
        meant its actor to stay as it was: no line)."""
        if self.outcomes.get("updated") or not set(self.outcomes) - {"frozen"}:
            return
        said = {**NO_UPDATE_CAUSES, "frozen": f"frozen by actor.freeze_steps={self.freeze_steps}"}
        causes = "; ".join(f"{n} step(s) {said[why]}" for why, n in self.outcomes.items() if why in said)
        self.log.write(f"warning: this run made no update in its {steps} steps: nothing was learned ({causes})")
