"""The visual search agent (environments/visual_search.py) against the image service
(environments/image_search_service.py) started for real from its documented command on 127.0.0.1,
over the bundled slides (stub/data/visual_search): searches return real PIL images, bbox crops are
the right pixels and size, bad bboxes get a message instead of an exception, and reward_fn combines
judge and NDCG as computed independently here.

No real vision-language model can be served on this CPU machine, so the frozen generator and the
judge are a STAND-IN: a tiny FastAPI app on 127.0.0.1 speaking the OpenAI chat API
(`/v1/models`, `/v1/chat/completions`), reached through the official `openai` client exactly as a
real server would be. As the generator it records the `image_url` parts it receives (the tests
check they decode to the images the episode gathered) and replies what the test sets; as the judge
it scores 1 when the candidate equals the reference, else 0."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import re
import sys
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from PIL import Image

from conftest import ROOT, free_port, running
from train.workers.environment import EnvCallError, Environment, message_problem

ENV = "environments/visual_search.py"
DATA = ROOT / "stub" / "data" / "visual_search"
CORPUS = DATA / "corpus.jsonl"


def slide(sid: str) -> Image.Image:
    with Image.open(DATA / "images" / f"{sid}.png") as img:
        return img.convert("RGB")


def same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and a.convert("RGB").tobytes() == b.convert("RGB").tobytes()


# ---------------------------------------------------------------------------------- services

@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The image service from its documented command (the embedding model loads once per module)."""
    tmp = tmp_path_factory.mktemp("image_search")
    port = free_port()
    cmd = [sys.executable, "environments/image_search_service.py", "--corpus_path", str(CORPUS.relative_to(ROOT)),
           "--top_k", "3", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with running(cmd, url + "/health", tmp / "service.log"):
        yield url


class StandIn:
    """The stand-in for the frozen generator and the judge (see the module docstring)."""

    def __init__(self) -> None:
        self.reply = "<answer>0</answer>"
        self.delay = 0.0
        self.generator_requests: list[dict] = []
        self.judge_requests: list[dict] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "stand-in", "object": "model", "created": 0, "owned_by": "test"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            if self.delay:
                await asyncio.sleep(self.delay)
            user = body["messages"][-1]["content"]
            if isinstance(user, list):  # the generator's request: image_url parts, then the question
                self.generator_requests.append(body)
                text = self.reply
            else:  # the judge's request (judge_ndcg's format)
                self.judge_requests.append(body)
                reference = re.search(r"Reference answer: (.*)\n", user).group(1)
                candidate = re.search(r"BEGIN\n(.*)\nCANDIDATE-", user, re.DOTALL).group(1)
                text = json.dumps({"score": 1.0 if candidate.strip() == reference.strip() else 0.0})
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        self.app = app


@pytest.fixture(scope="module")
def stand_in():
    import uvicorn

    fake = StandIn()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stand-in server did not start"
        time.sleep(0.05)
    fake.url = f"http://127.0.0.1:{port}/v1"
    yield fake
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def env(service, stand_in, monkeypatch):
    for key in ("GENERATOR_MODEL", "JUDGE_MODEL", "RM_JUDGE_COEF", "RM_NDCG_COEF", "VSEARCH_TOP_K",
                "VSEARCH_NDCG_K", "VSEARCH_REQUIRE_COMPLETE", "GENERATOR_MAX_IMAGES"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VSEARCH_URL", service)
    monkeypatch.setenv("GENERATOR_BASE_URL", stand_in.url)
    monkeypatch.setenv("JUDGE_BASE_URL", stand_in.url)
    stand_in.reply, stand_in.delay = "<answer>0</answer>", 0.0
    stand_in.generator_requests.clear()
    stand_in.judge_requests.clear()
    environment = Environment(ENV, timeout_s=60, max_workers=2, max_turns=6)
    environment.pop_api_calls()
    yield environment
    environment.close()


def episode(env: Environment, question: str, turns: list[str]) -> list[dict]:
    """The conversation after each assistant turn and interact's reply (through the trainer's
    Environment wrapper, which checks every returned message)."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": question}]
    for turn in turns:
        messages.append({"role": "assistant", "content": turn})
        messages += asyncio.run(env.interact(messages))
    return messages


def tool_replies(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["role"] == "tool"]


def images(message: dict) -> list[Image.Image]:
    return [p["image"] for p in message["content"] if p["type"] == "image"] if isinstance(message["content"], list) else []


# ------------------------------------------------------------------------------------- service

def test_service_endpoints(service):
    health = httpx.get(service + "/health").json()
    assert health["status"] == "ok" and health["images"] == 40 and health["top_k"] == 3
    out = httpx.post(service + "/search", json={"query": "What was the rainfall of Vorel in 2022?"}).json()
    assert [r["id"] for r in out["results"]][0] == "s000" and len(out["results"]) == 3
    scores = [r["score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1.0001
    first = Image.open(io.BytesIO(base64.b64decode(out["results"][0]["image"])))
    assert first.format == "PNG" and same_pixels(first, slide("s000"))
    assert out["results"][0]["title"] == "Vorel rainfall" and out["results"][0]["width"] == 128
    assert len(httpx.post(service + "/search", json={"query": "Vorel", "top_k": 1}).json()["results"]) == 1
    assert httpx.post(service + "/search", json={"query": "x", "top_k": 0}).status_code == 422
    assert httpx.post(service + "/search", json={"query": "x", "top_k": 51}).status_code == 422
    png = httpx.get(service + "/image/s000")
    assert png.headers["content-type"] == "image/png" and same_pixels(Image.open(io.BytesIO(png.content)), slide("s000"))
    assert httpx.get(service + "/image/nope").status_code == 404


def test_every_question_finds_its_slide_in_the_top_3(service):
    rows = [json.loads(line) for split in ("train", "test") for line in open(DATA / f"{split}.jsonl")]
    found = 0
    with httpx.Client(base_url=service) as client:
        for row in rows:
            ids = [r["id"] for r in client.post("/search", json={"query": row["messages"][-1]["content"]})
                   .json()["results"]]
            found += row["answer"]["gold_ids"][0] in ids
    assert len(rows) == 80 and found == len(rows)


# -------------------------------------------------------------------------------------- interact

def test_search_returns_slides_as_images(env):
    messages = episode(env, "q", ["<think>hmm</think><search>Vorel rainfall</search>"])
    (reply,) = tool_replies(messages)
    assert message_problem(reply) is None and reply["doc_ids"][0] == "s000" and len(reply["doc_ids"]) == 3
    texts = [p["text"] for p in reply["content"] if p["type"] == "text"]
    assert texts[0] == "[s000] Vorel rainfall (128x128)" and "crops s000" in texts[-1]
    got = images(reply)
    assert len(got) == 3 and all(isinstance(i, Image.Image) for i in got)
    for sid, image in zip(reply["doc_ids"], got):
        assert same_pixels(image, slide(sid))
    # every image part right after the text line naming it
    kinds = [p["type"] for p in reply["content"]]
    assert kinds == ["text", "image"] * 3 + ["text"]
    empty = episode(env, "q", ["<search>  </search>"])[-1]
    assert empty["content"].startswith("Empty query") and empty["doc_ids"] == []


def test_bbox_crops_the_first_slide_of_the_latest_search(env):
    messages = episode(env, "q", ["<search>Vorel rainfall</search>", "<search>Kestra population</search>",
                                  "<bbox>[10, 40, 74, 120]</bbox>", "<bbox>[10.5, 40, 20.2, 50]</bbox>",
                                  "<bbox>[-20, -5, 300, 60]</bbox>"])
    second_search, crop, fractional, clamped = tool_replies(messages)[1:]
    target = second_search["doc_ids"][0]
    assert target == "s009"  # Kestra population
    (image,) = images(crop)
    assert isinstance(image, Image.Image) and image.size == (64, 80)
    assert same_pixels(image, slide(target).crop((10, 40, 74, 120)))
    assert crop["crop_of"] == target and crop["bbox"] == [10, 40, 74, 120] and crop["doc_ids"] == []
    assert crop["content"][0]["text"] == f"Crop [10, 40, 74, 120] of {target}, 64x80 pixels:"
    (image,) = images(fractional)  # fractions round outwards: x 10..21, y 40..50
    assert image.size == (11, 10) and same_pixels(image, slide(target).crop((10, 40, 21, 50)))
    (image,) = images(clamped)
    assert image.size == (128, 60) and same_pixels(image, slide(target).crop((0, 0, 128, 60)))
    assert "clamped" in clamped["content"][0]["text"]
    calls = env.pop_api_calls()
    assert sum(c["type"] == "crop" for c in calls) == 3 and sum(c["type"] == "image_search" for c in calls) == 2
    assert all(c["ok"] for c in calls)


@pytest.mark.parametrize("bbox, says", [
    ("[200, 200, 300, 300]", "lies outside the 128x128 image"),
    ("[1, 2, 3]", "write four numbers"),
    ("[1, 2, 3, x]", "write four numbers"),
    ("1, 2, 3, 4", "write four numbers"),
    ("[nan, 0, 10, 10]", "write four numbers"),
    ("", "write four numbers"),
    ("[50, 50, 10, 10]", "need x1 < x2 and y1 < y2"),
    ("[5, 5, 5, 9]", "need x1 < x2 and y1 < y2"),
])
def test_bad_bbox_is_a_message_not_a_crash(env, bbox, says):
    messages = episode(env, "q", ["<search>Vorel rainfall</search>", f"<bbox>{bbox}</bbox>"])
    reply = messages[-1]
    assert reply["role"] == "tool" and isinstance(reply["content"], str), reply
    assert reply["content"].startswith("Cannot crop:") and says in reply["content"], reply["content"]
    crops = [c for c in env.pop_api_calls() if c["type"] == "crop"]
    assert len(crops) == 1 and not crops[0]["ok"]  # counted: api/crop/errors is the invalid-bbox rate


def test_bbox_before_any_search(env):
    reply = episode(env, "q", ["<bbox>[0, 0, 10, 10]</bbox>"])[-1]
    assert "search first" in reply["content"] and reply["doc_ids"] == []


def test_search_complete_or_no_tag_ends_the_episode(env):
    for last in ("<search_complete>true</search_complete>", "I am done.", "<think>only</think>"):
        messages = episode(env, "q", ["<search>Vorel rainfall</search>", last])
        assert messages[-1] == {"role": "assistant", "content": last}
    # the first tag decides: a search before a search_complete is a search
    messages = episode(env, "q", ["<search>Oshen visitors</search> <search_complete>true</search_complete>"])
    assert tool_replies(messages)[0]["doc_ids"][0] == "s027"


# ------------------------------------------------------------------------------------------ reward

def ndcg_by_hand(ranked: list[str], gold: str, k: int) -> float:
    """Binary relevance, one gold id: 1 / log2(rank + 1) if it is in the top k (the ideal DCG is 1)."""
    dedup = list(dict.fromkeys(ranked))[:k]
    return 1.0 / math.log2(dedup.index(gold) + 2) if gold in dedup else 0.0


def test_reward_is_judge_plus_ndcg(env, stand_in, monkeypatch):
    monkeypatch.setenv("RM_JUDGE_COEF", "0.7")
    monkeypatch.setenv("RM_NDCG_COEF", "0.3")
    monkeypatch.setenv("GENERATOR_MAX_IMAGES", "4")
    question = "What was the population of Vorel in 2022, in thousands of people?"
    answer = {"target": "831", "gold_ids": ["s008"]}  # Vorel population; "Vorel rainfall" ranks it below s000
    messages = episode(env, question, ["<search>Vorel rainfall</search>", "<bbox>[0, 40, 128, 128]</bbox>",
                                       "<search_complete>true</search_complete>"])
    ranked = tool_replies(messages)[0]["doc_ids"]
    assert ranked[0] == "s000" and "s008" in ranked[1:]  # the gold slide is there, but not first
    ndcg = ndcg_by_hand(ranked, "s008", 3)
    assert 0 < ndcg < 1

    stand_in.reply = "Looking at the slide... <answer> 831 </answer>"
    reward = asyncio.run(env.reward(messages, answer))
    assert reward == pytest.approx(0.7 * 1.0 + 0.3 * ndcg, abs=1e-12)
    # what the generator was sent: the question, and the last 4 gathered images as PNG data URLs
    (request,) = stand_in.generator_requests
    parts = request["messages"][-1]["content"]
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert parts[-1] == {"type": "text", "text": f"Question: {question}"} and len(urls) == 4
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    sent = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in urls]
    gathered = [slide(s) for s in ranked] + [slide("s000").crop((0, 40, 128, 128))]
    assert all(same_pixels(a, b) for a, b in zip(sent, gathered[-4:]))
    (judged,) = stand_in.judge_requests  # the judge grades the generator's answer against the target
    assert "Reference answer: 831" in judged["messages"][-1]["content"]

    stand_in.reply = "<answer>830</answer>"  # wrong: the judge gives 0, NDCG stays
    assert asyncio.run(env.reward(messages, answer)) == pytest.approx(0.3 * ndcg, abs=1e-12)
    stats = env.module.pop_reward_stats()
    assert stats["visual_search/scored"] == 2 and stats["visual_search/judge_mean"] == 0.5
    assert stats["visual_search/ndcg_mean"] == pytest.approx(ndcg)
    kinds = {c["type"] for c in env.pop_api_calls()}
    assert {"image_search", "crop", "generator", "judge"} <= kinds


def test_default_coefficients_and_a_perfect_search(env, stand_in):
    question = "What was the rainfall of Vorel in 2022, in millimetres?"
    messages = episode(env, question, ["<search>rainfall of Vorel</search>", "<search_complete>true</search_complete>"])
    assert tool_replies(messages)[0]["doc_ids"][0] == "s000"
    stand_in.reply = "<answer>12</answer>"
    reward = asyncio.run(env.reward(messages, {"target": "13", "gold_ids": ["s000"]}))
    assert reward == pytest.approx(0.5 * 0.0 + 0.5 * 1.0)  # gold first: NDCG 1; wrong answer: judge 0


def test_incomplete_episode_scores_zero_without_calls(env, stand_in, monkeypatch):
    messages = episode(env, "q", ["<search>Vorel rainfall</search>", "<search>Vorel rainfall</search>"])
    assert asyncio.run(env.reward(messages, {"target": "1", "gold_ids": ["s000"]})) == 0.0
    assert not stand_in.generator_requests and not stand_in.judge_requests
    assert env.module.pop_reward_stats()["visual_search/incomplete"] == 1
    monkeypatch.setenv("VSEARCH_REQUIRE_COMPLETE", "0")
    monkeypatch.setenv("RM_JUDGE_COEF", "0")  # NDCG only: no generator call either
    assert asyncio.run(env.reward(messages, {"target": "1", "gold_ids": ["s000"]})) == pytest.approx(0.5)
    assert not stand_in.generator_requests


# ----------------------------------------------------------------------------------------- failures

def test_dead_search_service_raises_naming_it(env, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("VSEARCH_URL", dead)
    monkeypatch.setenv("VSEARCH_RETRIES", "1")
    with pytest.raises(EnvCallError) as err:
        episode(env, "q", ["<search>Vorel</search>"])
    assert f"image search at {dead}/search failed after 2 attempts" in str(err.value)
    calls = [c for c in env.pop_api_calls() if c["type"] == "image_search"]
    assert len(calls) == 2 and not any(c["ok"] for c in calls)


def test_slow_generator_times_out_naming_what_it_waited_for(env, stand_in, monkeypatch):
    messages = episode(env, "q", ["<search>Vorel rainfall</search>", "<search_complete>true</search_complete>"])
    monkeypatch.setenv("GENERATOR_TIMEOUT_S", "0.3")
    monkeypatch.setenv("GENERATOR_MAX_RETRIES", "1")
    monkeypatch.setenv("GENERATOR_BACKOFF_S", "0.01")
    stand_in.delay = 1.0
    with pytest.raises(EnvCallError) as err:
        asyncio.run(env.reward(messages, {"target": "1", "gold_ids": ["s000"]}))
    assert f"frozen generator at {stand_in.url}/ failed after 2 attempts: no reply within GENERATOR_TIMEOUT_S=0.3 s" \
        in str(err.value)
    stand_in.delay = 0.0
    monkeypatch.setenv("GENERATOR_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(EnvCallError, match="failed after 2 attempts: APIConnectionError"):
        asyncio.run(env.reward(messages, {"target": "1", "gold_ids": ["s000"]}))


def test_dead_judge_raises_naming_it(env, stand_in, monkeypatch):
    messages = episode(env, "q", ["<search>Vorel rainfall</search>", "<search_complete>true</search_complete>"])
    dead = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.setenv("JUDGE_BASE_URL", dead)
    monkeypatch.setenv("JUDGE_MAX_RETRIES", "0")
    stand_in.reply = "<answer>7</answer>"
    with pytest.raises(EnvCallError) as err:
        asyncio.run(env.reward(messages, {"target": "1", "gold_ids": ["s000"]}))
    assert f"judge at {dead} (JUDGE_TIMEOUT_S=20 s per attempt): judge failed after 1 attempts" in str(err.value)

