"""External-call latency statistics against hand-computed values."""
import asyncio

import pytest

from train.utils.api_stats import ApiCallRecorder, errors_by_kind, summarize


def test_summarize_hand_computed():
    records = [{"type": "judge", "latency_s": float(v), "wait_s": 0.5, "ok": v != 7} for v in range(1, 11)]
    records.append({"type": "search", "latency_s": 2.0, "wait_s": 0.0, "ok": True})
    out = summarize(records)
    assert out["api/judge/count"] == 10 and out["api/judge/errors"] == 1
    # nearest rank: p50 of 1..10 is the 5th value, p95 and p99 the 10th
    assert out["api/judge/p50_s"] == 5.0 and out["api/judge/p95_s"] == 10.0 and out["api/judge/p99_s"] == 10.0
    assert out["api/judge/max_s"] == 10.0 and out["api/judge/wait_s"] == pytest.approx(5.0)
    assert out["api/search/count"] == 1 and out["api/search/p50_s"] == 2.0
    assert summarize([]) == {}


def test_recorder_times_waits_and_errors():
    rec = ApiCallRecorder()
    limiter = asyncio.Semaphore(1)

    async def one(fail: bool):
        async with rec.call("tool", limiter):
            await asyncio.sleep(0.05)
            if fail:
                raise RuntimeError("x")

    async def main():
        return await asyncio.gather(one(False), one(True), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[1], RuntimeError)
    calls = rec.pop()
    assert len(calls) == 2 and rec.pop() == []
    assert sum(not c["ok"] for c in calls) == 1
    assert [c["error"] for c in calls if not c["ok"]] == ["RuntimeError: x"]  # what failed is kept
    assert max(c["wait_s"] for c in calls) >= 0.04  # the second call waited on the limiter
    assert all(c["latency_s"] >= 0.04 for c in calls)


def test_failed_calls_are_named_by_kind_and_frequency():
    calls = [{"type": "search", "latency_s": 1.0, "wait_s": 0.0, "ok": False, "error": "ReadTimeout: timed out"}] * 3
    calls += [{"type": "search", "latency_s": 1.0, "wait_s": 0.0, "ok": False, "error": "RemoteProtocolError: x"}]
    calls += [{"type": "search", "latency_s": 1.0, "wait_s": 0.0, "ok": True},
              {"type": "judge", "latency_s": 1.0, "wait_s": 0.0, "ok": False}]  # a record without its error
    assert errors_by_kind(calls) == {"search": {"ReadTimeout: timed out": 3, "RemoteProtocolError: x": 1},
                                     "judge": {"failed": 1}}
    assert errors_by_kind(calls, keep=1) == {"search": {"ReadTimeout: timed out": 3}, "judge": {"failed": 1}}
    assert errors_by_kind(calls[4:5]) == {}
