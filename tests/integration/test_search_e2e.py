"""A searchr1 GRPO run on CPU with the tiny model against the search service started from its
documented command: the trajectories show the searches and the passages that came back."""
from __future__ import annotations

import httpx
import pytest

from conftest import read_jsonl, run_trainer, search_service


@pytest.mark.slow
def test_searchr1_run_shows_searches_and_passages(tmp_path, search_tiny, monkeypatch):
    with search_service(tmp_path) as url:
        monkeypatch.setenv("SEARCH_URL", url)
        run_trainer([f"trainer.save_dir={tmp_path / 'run'}", f"actor.model_name={search_tiny}",
                     "trainer.total_steps=2", "trainer.test_freq=null", "data.prompts_per_rollout=4",
                     "trainer.log_samples=16"], config="search")
        events = read_jsonl(tmp_path / "run" / "trajectories.jsonl")
        tools = [(s, e) for s in events if s["type"] == "sample" for e in s["events"] if e["type"] == "tool"]
        assert tools, "no sample searched"
        for sample, event in tools:
            msgs = sample["messages"]
            i = next(k for k, m in enumerate(msgs) if m["role"] == "tool")
            query = msgs[i - 1]["content"].split("<search>", 1)[1].split("</search>", 1)[0].strip()
            tool = event["messages"][0]
            assert tool == msgs[i] and tool["role"] == "tool" and len(tool["doc_ids"]) == 3
            assert [line.split("]")[0][1:] for line in tool["content"].splitlines()] == tool["doc_ids"]
            # the passages are what the service returns for that query
            direct = httpx.post(url + "/search", json={"query": query}).json()["results"]
            assert [d["id"] for d in direct] == tool["doc_ids"]
            assert msgs[i + 1]["role"] == "assistant"  # the policy went on after reading them
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert sum(m["api/search/count"] for m in metrics) >= len(tools)
    # No search was lost: a failed attempt (a loaded machine may time one out) was retried and then
    # answered, and the log names each failure.
    failed = {e: n for ev in events if ev["type"] == "api_errors" for e, n in ev["errors"]["search"].items()}
    assert sum(failed.values()) == sum(m["api/search/errors"] for m in metrics), failed
    assert all(m["env/errors"] == 0 for m in metrics), failed
    assert max(m["n_turns/train"] for m in metrics) > 1
    stats = [e for e in events if e["type"] == "api_stats"]
    assert stats and "api/search/p95_s" in stats[0]["stats"]
