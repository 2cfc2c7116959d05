"""Latency statistics of external calls made by env code (judge, search, sandbox, tool, ...).

An env module owns an `ApiCallRecorder` (one per process, created when the module loads), wraps
each call in `recorder.call(kind, limiter)`, and exposes `pop_api_calls = recorder.pop`. The
trainer collects the records after every rollout, gathers them to rank 0 and logs, per kind:
count, errors, p50/p95/p99/max latency and the time spent waiting on the local concurrency limit.
A failed call keeps its error (`ExceptionClass: message`, cut to 200 characters), so a run's log can
say what failed even when a retry then succeeded.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import AsyncIterator


class ApiCallRecorder:
    def __init__(self) -> None:
        self._records: list[dict] = []
        self._lock = threading.Lock()  # env calls may come from several threads

    @contextlib.asynccontextmanager
    async def call(self, kind: str, limiter: asyncio.Semaphore | None = None) -> AsyncIterator[None]:
        """Time one call: waiting for `limiter` (if any), then the call itself; an exception
        raised inside counts as an error and propagates."""
        queued = time.perf_counter()
        if limiter is not None:
            await limiter.acquire()
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            yield
        except BaseException as e:
            error = e
            raise
        finally:
            if limiter is not None:
                limiter.release()
            self.record(kind, time.perf_counter() - started, started - queued, error is None,
                        error=None if error is None else describe(error))

    def record(self, kind: str, latency_s: float, wait_s: float = 0.0, ok: bool = True,
               error: str | None = None) -> None:
        row = {"type": kind, "latency_s": latency_s, "wait_s": wait_s, "ok": ok}
        if not ok:
            row["error"] = error or "failed"
        with self._lock:
            self._records.append(row)

    def pop(self) -> list[dict]:
        with self._lock:
            records, self._records = self._records, []
        return records


def describe(error: BaseException) -> str:
    """`ExceptionClass: message`, one line, at most 200 characters."""
    text = f"{type(error).__name__}: {error}".strip().rstrip(":")
    return " ".join(text.split())[:200]


def errors_by_kind(records: list[dict], keep: int = 5) -> dict[str, dict[str, int]]:
    """Per call type, how often each distinct error occurred (the `keep` most frequent)."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        if not r["ok"]:
            seen = out.setdefault(r["type"], {})
            seen[r.get("error", "failed")] = seen.get(r.get("error", "failed"), 0) + 1
    return {kind: dict(sorted(seen.items(), key=lambda kv: -kv[1])[:keep]) for kind, seen in out.items()}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n * q / 100)
    return sorted_values[int(min(rank, len(sorted_values))) - 1]


def summarize(records: list[dict]) -> dict[str, float]:
    """Per call type: api/{type}/count, errors, p50_s, p95_s, p99_s, max_s, wait_s (total)."""
    by_type: dict[str, list[dict]] = {}
    for r in records:
        by_type.setdefault(r["type"], []).append(r)
    out: dict[str, float] = {}
    for kind, rows in sorted(by_type.items()):
        lat = sorted(r["latency_s"] for r in rows)
        prefix = f"api/{kind}/"
        out[prefix + "count"] = float(len(rows))
        out[prefix + "errors"] = float(sum(not r["ok"] for r in rows))
        for q in (50, 95, 99):
            out[prefix + f"p{q}_s"] = _percentile(lat, q)
        out[prefix + "max_s"] = lat[-1]
        out[prefix + "wait_s"] = float(sum(r["wait_s"] for r in rows))
    return out
