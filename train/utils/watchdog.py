"""A progress watchdog: a phase of the step (rollout, update, checkpoint, evaluation) that runs far
past its own history or a floor ends the rank with every thread's Python stack and one line naming
the phase, instead of hanging until a collective times out (30 minutes) or forever (an async env
that blocks the event loop cannot be interrupted by `rollout.env_timeout_s`).

The limit of a phase is max(`trainer.watchdog_min_s`, `trainer.watchdog_factor` x its longest run so
far). The rank exits with status 3 (torchrun then stops the others); checkpoints are atomic, so a
restart with `trainer.load_ckpt_from=latest` works.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

EXIT_STATUS = 3


class Watchdog:
    def __init__(self, min_s: float | None, factor: float, rank: int, dump_dir: str,
                 describe: Callable[[], str] | None = None, poll_s: float = 1.0):
        self.min_s, self.factor, self.rank, self.dump_dir = min_s, factor, rank, dump_dir
        self.describe = describe
        self.longest: dict[str, float] = {}
        self._current: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread = None
        if min_s is not None:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="watchdog", daemon=True)
            self._thread.start()

    def limit(self, phase: str) -> float:
        return max(self.min_s, self.factor * self.longest.get(phase, 0.0))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Watch the block as phase `name`; its duration joins the phase's history."""
        start = time.monotonic()
        self._current = (name, start)
        try:
            yield
        finally:
            self._current = None
            self.longest[name] = max(self.longest.get(name, 0.0), time.monotonic() - start)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            current = self._current
            if current is None:
                continue
            name, start = current
            elapsed, limit = time.monotonic() - start, self.limit(name)
            if elapsed > limit:
                self._abort(name, elapsed, limit)

    def _abort(self, name: str, elapsed: float, limit: float) -> None:
        detail = ""
        if self.describe is not None:
            try:
                detail = self.describe()
            except Exception as e:  # noqa: BLE001 - the abort must happen whatever describe does
                detail = f"(describing the rank failed: {e})"
        path = os.path.join(self.dump_dir, f"watchdog_rank{self.rank}.txt")
        line = (f"watchdog: rank {self.rank}: {name} has run for {elapsed:.0f} s, past its limit of {limit:.0f} s "
                f"(max(trainer.watchdog_min_s, trainer.watchdog_factor x its longest so far)){'; ' + detail if detail else ''}. "
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
