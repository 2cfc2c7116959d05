"""Search-R1 style environment: the policy searches a local corpus, then answers.

Each assistant turn is read for its first action tag:
- `<search>query</search>`: the query goes to the search service (environments/local_search_service.py)
  and the top-k passages come back as one `tool` message, one line per passage:
  `[d007] Title: text`. The message also carries the ids as `doc_ids` (judge_ndcg.py ranks them).
- `<answer>...</answer>` (or neither tag): the episode ends; `reward_fn` scores the last answer by
  normalised exact match (case, punctuation, articles, whitespace) against the row's answer.

The row's `answer` may be a string, a list of acceptable strings, or a dict with `target` (string or
list; also read: `answers`, `golden_answers`) as in stub/data/search/*.jsonl.

Settings come from environment variables, since the env contract passes no config:
  SEARCH_URL          service base URL (default http://127.0.0.1:8000)
  SEARCH_TOP_K        passages per search (default 3)
  SEARCH_TIMEOUT_S    per HTTP request (default 10)
  SEARCH_RETRIES      extra attempts after a failed request (default 2; backoff 0.2 s, doubling)
  SEARCH_CONCURRENCY  requests in flight per process (default 32)
  SEARCH_MAX_CHARS    characters kept per passage (default 300)
  SEARCH_INVALID_REPLY  1: answer a turn with neither tag with a hint and go on (Search-R1's
                      behaviour); default 0 ends the episode
  SEARCH_RETRIEVAL_REWARD  partial credit (default 0) for a wrong answer when a search returned one
                      of the row's `gold_ids`: a signal a tiny model can reach before exact match
A search that still fails after the retries raises: the rollout scores that sample with
`rollout.env_error_reward`, logs it, and the run goes on. Every request is timed by an
ApiCallRecorder under the type `search` (see train/utils/api_stats.py).
"""
from __future__ import annotations

import asyncio
import os
import re
import string

import httpx

from train.utils.api_stats import ApiCallRecorder
from train.utils.http_pool import pool_limits

ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
INVALID_REPLY = ("No action found. To search, write <search>query</search>; "
                 "to answer, write <answer>...</answer>.")

recorder = ApiCallRecorder()
pop_api_calls = recorder.pop


def _setting(name: str, default: str) -> str:
    return os.environ.get(name, default)


class SearchClient:
    """One pooled httpx.AsyncClient and concurrency limit per event loop (clients must never be
    shared across loops). Settings are read when a loop first uses the client."""

    def __init__(self) -> None:
        self._per_loop: dict[asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, asyncio.Semaphore]] = {}

    def _get(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        for old in [lp for lp in self._per_loop if lp.is_closed()]:
            del self._per_loop[old]  # a closed loop's client cannot be used or closed any more
        if loop not in self._per_loop:
            n = int(_setting("SEARCH_CONCURRENCY", "32"))
            client = httpx.AsyncClient(
                base_url=_setting("SEARCH_URL", "http://127.0.0.1:8000").rstrip("/"),
                timeout=float(_setting("SEARCH_TIMEOUT_S", "10")),
                limits=pool_limits(n))
            self._per_loop[loop] = (client, asyncio.Semaphore(n))
        return self._per_loop[loop]

    async def search(self, query: str, top_k: int | None = None) -> list[dict]:
        client, limit = self._get()
        body = {"query": query, "top_k": top_k or int(_setting("SEARCH_TOP_K", "3"))}
        retries, delay = int(_setting("SEARCH_RETRIES", "2")), 0.2
        for attempt in range(retries + 1):
            try:
                async with recorder.call("search", limit):
                    resp = await client.post("/search", json=body)
                    resp.raise_for_status()
                    return resp.json()["results"]
            except (httpx.TransportError, httpx.HTTPStatusError) as e:
                # 4xx other than 429 will not get better by asking again
                if isinstance(e, httpx.HTTPStatusError) and e.response.status_code < 500 \
                        and e.response.status_code != 429:
                    raise
                if attempt == retries:
                    raise
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        entry = self._per_loop.pop(loop, None)
        if entry is not None:
            await entry[0].aclose()


client = SearchClient()


def format_passages(results: list[dict], max_chars: int | None = None) -> str:
    """One line per passage, `[id] title: text`, so ids survive into the conversation."""
    if max_chars is None:
        max_chars = int(_setting("SEARCH_MAX_CHARS", "300"))
    lines = []
    for r in results:
        text = str(r.get("contents", ""))
        title = r.get("title")
        if title and text.startswith(f"{title}\n"):
            text = text[len(title) + 1:]
        # one line per passage keeps the ids parseable; the cut bounds the tokens a search adds
        body = " ".join((f"{title}: {text}" if title else text).split())[:max_chars]
        lines.append(f"[{r['id']}] {body}")
    return "\n".join(lines) if lines else "No results."


def last_assistant(messages: list[dict]) -> str:
    return next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")


def parse_action(text: str) -> tuple[str | None, str]:
    """('search', query) / ('answer', text) for the turn's first action tag, else (None, '')."""
    m = ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


async def interact(messages: list[dict]) -> list[dict]:
    action, content = parse_action(last_assistant(messages))
    if action == "search":
        if not content:
            return [{"role": "tool", "content": "Empty query: write the query between <search> and </search>.",
                     "doc_ids": []}]
        results = await client.search(content)
        return [{"role": "tool", "content": format_passages(results), "doc_ids": [str(r["id"]) for r in results]}]
    if action is None and _setting("SEARCH_INVALID_REPLY", "0") == "1":
        return [{"role": "tool", "content": INVALID_REPLY, "doc_ids": []}]
    return []


def normalize(text: object) -> str:
    """SQuAD-style answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def targets(answer: object) -> list[str]:
    if isinstance(answer, dict):
        for key in ("target", "answers", "golden_answers", "answer"):
            if key in answer:
                return targets(answer[key])
        return []
    if isinstance(answer, (list, tuple)):
        return [str(a) for a in answer]
    return [str(answer)]


def extract_answer(messages: list[dict]) -> str | None:
    found = ANSWER.findall(last_assistant(messages))
    return found[-1] if found else None


def exact_match(prediction: str | None, answer: object) -> float:
    if prediction is None:
        return 0.0
    got = normalize(prediction)
    return float(any(got == normalize(t) for t in targets(answer)))


def retrieved_gold(messages: list[dict], answer: object) -> bool:
    """Whether any search of the episode returned one of the row's `gold_ids` (False without them)."""
    gold = answer.get("gold_ids") if isinstance(answer, dict) else None
    if not gold:
        return False
    seen = {str(i) for m in messages if m.get("role") == "tool" for i in (m.get("doc_ids") or [])}
    return any(str(g) in seen for g in gold)


def reward_fn(messages: list[dict], answer: object) -> float:
    score = exact_match(extract_answer(messages), answer)
    credit = float(_setting("SEARCH_RETRIEVAL_REWARD", "0"))
    if score == 0.0 and credit and retrieved_gold(messages, answer):
        return credit  # partial credit: the right passage was found, the answer was not right
    return score
