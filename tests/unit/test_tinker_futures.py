"""train/tinker_service/futures.py: a model's requests run in seq_id order, one at a time; a gap is waited for
and then skipped; a full queue refuses; a request that waited past its deadline fails without running."""
from __future__ import annotations

import asyncio

import pytest

from train.tinker_service.futures import ModelQueue, QueueFull, RequestBook


def on_error(e: BaseException) -> tuple[str, bool]:
    return str(e), isinstance(e, ValueError)


def run(coro):
    return asyncio.run(coro)


def test_requests_run_in_seq_order_one_at_a_time_whatever_order_they_arrive_in():
    async def go():
        book, ran, active = RequestBook(), [], [0]
        queue = ModelQueue(book, on_error, gap_s=5)

        def job(seq):
            async def work():
                active[0] += 1
                assert active[0] == 1  # one in flight
                await asyncio.sleep(0.01)
                ran.append(seq)
                active[0] -= 1
                return {"seq": seq}
            return work
        rids = {}
        for seq in (1, 3, 2, 4):  # a chunked forward_backward's chunks may arrive out of order
            rids[seq] = book.new()
        queue.put(1, rids[1], job(1), 60)
        await asyncio.sleep(0.05)
        for seq in (3, 2, 4):
            queue.put(seq, rids[seq], job(seq), 60)
        outs = [await book.poll(rids[s], 2) for s in (1, 2, 3, 4)]
        queue.close()
        return ran, [o.body for o in outs]
    ran, bodies = run(go())
    assert ran == [1, 2, 3, 4] and bodies == [{"seq": s} for s in (1, 2, 3, 4)]


def test_a_missing_seq_id_is_waited_for_then_skipped_and_failures_stay_with_their_request():
    async def go():
        book = RequestBook()
        queue = ModelQueue(book, on_error, gap_s=0.2)
        first, third = book.new(), book.new()

        async def ok():
            return {"ok": True}

        async def bad():
            raise ValueError("data[0]: wrong")
        queue.put(1, first, bad, 60)
        queue.put(3, third, ok, 60)  # seq 2 never comes
        a, b = await book.poll(first, 2), await book.poll(third, 2)
        queue.close()
        return a.body, b.body
    failed, done = run(go())
    assert failed == {"error": "data[0]: wrong", "category": "user"} and done == {"ok": True}


def test_a_full_queue_refuses_and_a_stale_request_fails_without_running():
    async def go():
        book = RequestBook()
        queue = ModelQueue(book, on_error, limit=2, gap_s=0.1)
        gate, ran = asyncio.Event(), []

        async def slow():
            await gate.wait()
            return {}

        async def never():
            ran.append(True)
            return {}
        queue.put(1, book.new(), slow, 60)
        await asyncio.sleep(0.01)  # seq 1 runs; the next two wait
        stale = book.new()
        queue.put(2, stale, never, 0.05)
        queue.put(3, book.new(), slow, 60)
        with pytest.raises(QueueFull):
            queue.put(4, book.new(), slow, 60)
        await asyncio.sleep(0.1)
        gate.set()
        out = await book.poll(stale, 2)
        queue.close()
        return out.body, ran
    body, ran = run(go())
    assert body["category"] == "server" and "--request-timeout-s" in body["error"] and not ran


def test_an_unfinished_request_is_held_then_answered_pending_and_unknown_ids_are_none():
    async def go():
        book = RequestBook()
        rid = book.new()
        pending = await book.poll(rid, 0.05)
        return pending.done.is_set(), await book.poll("nope", 0.01)
    done, unknown = run(go())
    assert done is False and unknown is None
