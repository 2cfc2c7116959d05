"""Tinker's futures: every mutating call answers a request id at once; the client polls `retrieve_future`.

A poll for an unfinished request is held up to `hold_s` and then answered `try_again` (the SDK polls again at
once, so holding keeps the polling cheap); a finished one returns its result (protobuf or JSON), a failed one
`{"error", "category"}`, which the SDK raises as `RequestFailedError`. Results are kept `keep_s` after they
finish (a client that never polls does not keep them forever).

Training requests of one model run in `seq_id` order (the SDK numbers them, and may send a forward_backward's
chunks out of order), one at a time; a gap in the numbering (a request the client never sent) is waited for
`gap_s` and then skipped. Each model holds at most `limit` waiting requests: more is answered 429, which the
SDK retries with backoff (backpressure).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable


@dataclass
class Outcome:
    done: asyncio.Event = field(default_factory=asyncio.Event)
    body: bytes | dict | None = None  # bytes: protobuf; dict: JSON
    finished_at: float | None = None


class RequestBook:
    def __init__(self, keep_s: float = 3600.0) -> None:
        self.keep_s = keep_s
        self._items: dict[str, Outcome] = {}

    def new(self) -> str:
        self._evict()
        rid = uuid.uuid4().hex
        self._items[rid] = Outcome()
        return rid

    def finish(self, rid: str, body: bytes | dict) -> None:
        item = self._items.get(rid)
        if item is not None and not item.done.is_set():
            item.body, item.finished_at = body, time.monotonic()
            item.done.set()

    def fail(self, rid: str, message: str, user: bool) -> None:
        self.finish(rid, {"error": message, "category": "user" if user else "server"})

    async def poll(self, rid: str, hold_s: float) -> Outcome | None:
        """The request's outcome once finished (within `hold_s`), else the pending Outcome; None: unknown id."""
        item = self._items.get(rid)
        if item is None:
            return None
        try:
            await asyncio.wait_for(item.done.wait(), hold_s)
        except asyncio.TimeoutError:
            pass
        return item

    def _evict(self) -> None:
        now = time.monotonic()
        old = [k for k, v in self._items.items() if v.finished_at is not None and now - v.finished_at > self.keep_s]
        for k in old:
            del self._items[k]


class QueueFull(Exception):
    pass


@dataclass(order=True)
class _Job:
    seq_id: int
    order: int
    rid: str = field(compare=False)
    deadline: float = field(compare=False)
    run: Callable[[], Awaitable[bytes | dict]] = field(compare=False)


class ModelQueue:
    """One model's training requests, run in seq_id order, one at a time (see the module docstring)."""

    def __init__(self, book: RequestBook, on_error: Callable[[BaseException], tuple[str, bool]],
                 limit: int = 64, gap_s: float = 30.0) -> None:
        self.book, self.on_error, self.limit, self.gap_s = book, on_error, limit, gap_s
        self._heap: list[_Job] = []
        self._count = itertools.count()
        self._arrived = asyncio.Event()
        self._next: int | None = None  # the seq_id the model waits for; None: whatever comes first
        self._task: asyncio.Task | None = None

    def put(self, seq_id: int | None, rid: str, run: Callable[[], Awaitable[Any]], timeout_s: float) -> None:
        if len(self._heap) >= self.limit:
            raise QueueFull(f"{len(self._heap)} requests already wait for this model")
        order = next(self._count)
        seq = order if seq_id is None else int(seq_id)
        heapq.heappush(self._heap, _Job(seq, order, rid, time.monotonic() + timeout_s, run))
        self._arrived.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while True:
            if not self._heap:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            job = self._heap[0]
            if self._next is not None and job.seq_id > self._next:
                self._arrived.clear()
                try:  # wait for the missing seq_id, at most gap_s
                    await asyncio.wait_for(self._arrived.wait(), self.gap_s)
                    continue
                except asyncio.TimeoutError:
                    pass
            heapq.heappop(self._heap)
            self._next = job.seq_id + 1
            if time.monotonic() > job.deadline:
                self.book.fail(job.rid, "the request waited in its model's queue past the service's "
                               "--request-timeout-s and was dropped before it ran", user=False)
                continue
            try:
                self.book.finish(job.rid, await job.run())
            except Exception as e:  # noqa: BLE001 - the request fails, the model goes on
                message, user = self.on_error(e)
                self.book.fail(job.rid, message, user)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
