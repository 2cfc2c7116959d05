"""A progress watchdog: a phase of the step (rollout, update, checkpoint, evaluation) that runs far
past its own history or a floor ends the rank with every thread's Python stack and one line naming
the phase, instead of hanging until a collective times out (30 minutes) or forever (an async env
that blocks the event loop cannot be interrupted by `rollout.env_timeout_s`).

The limit of a phase is max(`trainer.watchdog_min_s`, `trainer.watchdog_factor` x its longest run so
far), or a fixed limit given with the phase (the weight push: `rollout.push_timeout_s`). Phases nest
(the push runs inside the update); each is watched against its own limit. The rank exits with status 3 (torchrun then stops the others); checkpoints are atomic, so a
restart with `trainer.load_ckpt_from=latest` works.
"""
from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

EXIT_STATUS = 3


@dataclass(frozen=True)
class _Phase:
    name: str
    start: float
    limit_s: float | None  # None: judged against the phase's history
    limit_key: str  # the config key that set limit_s, for the message
    describe: Callable[[], str] | None


class Watchdog:
    def __init__(self, min_s: float | None, factor: float, rank: int, dump_dir: str,
                 describe: Callable[[], str] | None = None, poll_s: float = 1.0):
        self.min_s, self.factor, self.rank, self.dump_dir = min_s, factor, rank, dump_dir
        self.describe = describe
        self.longest: dict[str, float] = {}
        self._open: list[_Phase] = []  # the phases running now, outermost first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="watchdog", daemon=True)
        self._thread.start()

    def limit(self, phase: str, fixed_s: float | None = None) -> float:
        if fixed_s is not None:
            return fixed_s
        if self.min_s is None:
            return math.inf
        return max(self.min_s, self.factor * self.longest.get(phase, 0.0))

    @contextlib.contextmanager
    def phase(self, name: str, limit_s: float | None = None, limit_key: str = "",
              describe: Callable[[], str] | None = None) -> Iterator[None]:
        """Watch the block as phase `name` (against `limit_s`, set by config key `limit_key`, if given;
        else its history); its duration joins the phase's history. `describe` says where in the
        phase the rank is."""
        current = _Phase(name, time.monotonic(), limit_s, limit_key, describe)
        self._open = [*self._open, current]
        try:
            yield
        finally:
            self._open = [p for p in self._open if p is not current]
            self.longest[name] = max(self.longest.get(name, 0.0), time.monotonic() - current.start)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            for phase in self._open:
                elapsed, limit = time.monotonic() - phase.start, self.limit(phase.name, phase.limit_s)
                if elapsed > limit:
                    self._abort(phase, elapsed, limit)

    def _abort(self, phase: _Phase, elapsed: float, limit: float) -> None:
        details = []
        for describe in (phase.describe, self.describe):
            if describe is None:
                continue
            try:
                details.append(describe())
            except Exception as e:  # noqa: BLE001 - the abort must happen whatever describe does
                details.append(f"(describing the rank failed: {e})")
        detail = "; ".join(d for d in details if d)
        why = (phase.limit_key or "its fixed limit" if phase.limit_s is not None
               else "max(trainer.watchdog_min_s, trainer.watchdog_factor x its longest so far)")
        path = os.path.join(self.dump_dir, f"watchdog_rank{self.rank}.txt")
        line = (f"watchdog: rank {self.rank}: {phase.name} has run for {elapsed:.0f} s, past its limit of {limit:.0f} s "
                f"({why}){'; ' + detail if detail else ''}. "
                f"Every thread's Python stack follows (also in {path}); the rank exits with status {EXIT_STATUS}; "
                "restart with trainer.load_ckpt_from=latest")
        print(line, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            with open(path, "w") as f:
                f.write(line + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass
        os._exit(EXIT_STATUS)
