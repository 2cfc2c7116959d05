"""searchr1's partial credit for retrieving a gold passage (SEARCH_RETRIEVAL_REWARD, docs/search.md)."""
from __future__ import annotations

import importlib.util

from conftest import ROOT


def load_searchr1():
    spec = importlib.util.spec_from_file_location("searchr1_reward_test", ROOT / "environments" / "searchr1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def conversation(doc_ids: list[str], answer: str) -> list[dict]:
    return [{"role": "user", "content": "What is the capital of Quutark?"},
            {"role": "assistant", "content": "<search>capital of Quutark</search>"},
            {"role": "tool", "content": "...", "doc_ids": doc_ids},
            {"role": "assistant", "content": f"<answer>{answer}</answer>"}]


def test_a_search_that_found_a_gold_passage_earns_the_partial_credit(monkeypatch):
    env = load_searchr1()
    answer = {"target": "Naleth", "gold_ids": ["d000"]}
    found, missed = conversation(["d004", "d000"], "Quutark"), conversation(["d004", "d007"], "Quutark")
    assert env.reward_fn(found, answer) == 0.0  # off by default: exact match only
    monkeypatch.setenv("SEARCH_RETRIEVAL_REWARD", "0.5")
    assert env.reward_fn(found, answer) == 0.5
    assert env.reward_fn(missed, answer) == 0.0
    assert env.reward_fn(conversation(["d000"], "naleth"), answer) == 1.0  # a right answer keeps full marks
    assert env.reward_fn(found, "Naleth") == 0.0  # no gold_ids in the row: nothing to credit
