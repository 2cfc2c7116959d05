"""The local search service, started for real from its documented commands on 127.0.0.1, and
searchr1.py against it: single and batch forms, 200 concurrent queries, errors, interact/reward."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from conftest import SEARCH_DATA, free_port, search_service
from train.workers.environment import load_env_module


def qa_rows() -> list[dict]:
    rows = []
    for split in ("train", "test"):
        with open(SEARCH_DATA / f"{split}.jsonl") as f:
            rows += [json.loads(line) for line in f]
    return rows


# ------------------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with search_service(tmp_path_factory.mktemp("search")) as url:
        yield url


def test_index_metadata_and_health(service, tmp_path_factory):
    health = httpx.get(service + "/health").json()
    assert health["status"] == "ok" and health["documents"] == 60 and health["top_k"] == 3


def test_single_query_top_k_with_ids_and_scores(service):
    out = httpx.post(service + "/search", json={"query": "What is the capital of Quutark?"}).json()
    results = out["results"]
    assert len(results) == 3 and results[0]["id"] == "d000" and "Naleth" in results[0]["contents"]
    scores = [r["score"] for r in results]
    assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1.0001  # cosine similarity
    assert len(httpx.post(service + "/search", json={"query": "Naleth", "top_k": 1}).json()["results"]) == 1


def test_batch_form_keeps_request_order_and_ids(service):
    body = [{"query": "capital of Quutark", "id": "q-a", "request_idx": 7},
            {"query": "How high is Mount Lirail?", "id": "q-b", "request_idx": 3, "top_k": 1},
            {"query": "no request_idx here"}]
    for path in ("/search", "/batch_search"):
        out = httpx.post(service + path, json=body).json()
        assert [o["request_idx"] for o in out] == [7, 3, 2] and [o["id"] for o in out] == ["q-a", "q-b", None]
        assert out[0]["results"][0]["id"] == "d000" and [r["id"] for r in out[1]["results"]] == ["d003"]
        assert len(out[2]["results"]) == 3


def test_bad_requests_are_422(service):
    assert httpx.post(service + "/search", json={"q": "x"}).status_code == 422
    assert httpx.post(service + "/search", json={"query": "x", "top_k": 0}).status_code == 422
    r = httpx.post(service + "/search", json={"query": "x", "top_k": 1000})
    assert r.status_code == 422 and "max_top_k" in r.text


def test_request_size_limits(service):
    r = httpx.post(service + "/search", json={"query": "x" * 4097})
    assert r.status_code == 422 and "--max_query_chars" in r.text
    r = httpx.post(service + "/batch_search", json=[{"query": "ok"}, {"query": "x" * 4097}])
    assert r.status_code == 422 and "query 1" in r.text and "--max_query_chars" in r.text
    r = httpx.post(service + "/search", json=[{"query": "x"}] * 8193)
    assert r.status_code == 413 and "--max_queries" in r.text


@pytest.mark.slow
def test_a_big_batch_does_not_stall_a_single_query(service):
    """A single query sent while a 3000-query batch is being searched (seconds on a CPU) is answered
    after at most a chunk or two of it, not after the whole batch."""
    rows = qa_rows()
    big = [{"query": f"{rows[i % len(rows)]['messages'][-1]['content']} #{i}"} for i in range(3000)]

    async def race():
        async with httpx.AsyncClient(base_url=service, timeout=600) as client:
            before = (await client.get("/health")).json()["queries"]
            start = time.perf_counter()
            batch = asyncio.create_task(client.post("/batch_search", json=big))
            while (await client.get("/health")).json()["queries"] == before:  # the batch's first chunk is done
                await asyncio.sleep(0.05)
            sent = time.perf_counter()
            single = await client.post("/search", json={"query": "What is the capital of Quutark?"})
            single_done = time.perf_counter()
            batch_reply = await batch
            return single, batch_reply, single_done - sent, time.perf_counter() - start

    single, batch_reply, single_s, batch_s = asyncio.run(race())
    assert single.status_code == 200 and single.json()["results"][0]["id"] == "d000"
    assert batch_reply.status_code == 200 and len(batch_reply.json()) == 3000
    print(f"\nsingle query {single_s:.2f}s while a 3000-query batch took {batch_s:.2f}s")
    assert single_s < batch_s / 3


@pytest.mark.slow
def test_200_concurrent_queries_are_answered_correctly(service):
    rows = qa_rows()
    queries = [(rows[i % len(rows)]["messages"][-1]["content"], rows[i % len(rows)]["answer"]["gold_ids"])
               for i in range(200)]
    # Reference: every distinct question alone, one request at a time.
    alone = {q: httpx.post(service + "/search", json={"query": q}).json()["results"] for q, _ in queries[: len(rows)]}

    async def burst():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=service, limits=limits, timeout=60) as client:
            start = time.perf_counter()
            replies = await asyncio.gather(*(client.post("/search", json={"query": q}) for q, _ in queries))
            return replies, time.perf_counter() - start

    replies, elapsed = asyncio.run(burst())
    assert all(r.status_code == 200 for r in replies)
    for (q, gold), r in zip(queries, replies):
        out = r.json()
        assert out["query"] == q
        assert [d["id"] for d in out["results"]] == [d["id"] for d in alone[q]]
        assert [d["score"] for d in out["results"]] == pytest.approx([d["score"] for d in alone[q]], abs=1e-4)
        assert out["results"][0]["id"] in gold  # the gold passage ranks first for every stub question
    print(f"\n200 concurrent queries in {elapsed:.2f}s: {200 / elapsed:.0f} queries/s")
    health = httpx.get(service + "/health").json()
    assert health["batches"] < health["queries"]  # concurrent queries were batched together


def test_searchr1_interact_and_reward_against_the_live_service(service, monkeypatch):
    monkeypatch.setenv("SEARCH_URL", service)
    monkeypatch.setenv("SEARCH_TOP_K", "2")
    env = load_env_module("environments/searchr1.py")
    convo = [{"role": "user", "content": "What is the capital of Quutark?"},
             {"role": "assistant", "content": "Let me look. <search>capital of Quutark</search>"}]
    out = asyncio.run(env.interact(convo))
    assert len(out) == 1 and out[0]["role"] == "tool" and out[0]["doc_ids"][0] == "d000" and len(out[0]["doc_ids"]) == 2
    assert out[0]["content"].splitlines()[0] == "[d000] Quutark: Quutark is a small country. Its capital is Naleth."
    calls = env.pop_api_calls()
    assert [(c["type"], c["ok"]) for c in calls] == [("search", True)]
    answer = {"target": "Naleth", "gold_ids": ["d000"]}
    final = convo + out + [{"role": "assistant", "content": "<answer>  the NALETH. </answer>"}]
    assert env.reward_fn(final, answer) == 1.0
    assert env.reward_fn(convo + out + [{"role": "assistant", "content": "<answer>Quutark</answer>"}], answer) == 0.0
    assert env.reward_fn(final, ["x", "Naleth"]) == 1.0 and env.reward_fn(final, "naleth") == 1.0
    # an answer (or no tag) ends the episode; an empty query gets a hint, not a request
    assert asyncio.run(env.interact(final)) == []
    assert asyncio.run(env.interact([{"role": "assistant", "content": "hmm"}])) == []
    hint = asyncio.run(env.interact([{"role": "assistant", "content": "<search> </search>"}]))
    assert "Empty query" in hint[0]["content"] and env.pop_api_calls() == []
    monkeypatch.setenv("SEARCH_INVALID_REPLY", "1")
    assert "No action found" in asyncio.run(env.interact([{"role": "assistant", "content": "hmm"}]))[0]["content"]


def test_search_failure_is_retried_then_raised(monkeypatch):
    monkeypatch.setenv("SEARCH_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("SEARCH_RETRIES", "1")
    env = load_env_module("environments/searchr1.py")
    with pytest.raises(httpx.ConnectError):
        asyncio.run(env.interact([{"role": "assistant", "content": "<search>x</search>"}]))
    assert [(c["type"], c["ok"]) for c in env.pop_api_calls()] == [("search", False)] * 2
