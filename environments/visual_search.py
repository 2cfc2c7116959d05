"""Visual search agent (DDAI-style): the policy searches slides, zooms into one, and stops; a frozen
generator answers from the images it gathered; the reward is

    reward = RM_JUDGE_COEF * judge(generator's answer) + RM_NDCG_COEF * NDCG@k(retrieved ids, gold ids)

Each assistant turn is read for its first tag:
- `<search>query</search>`: the query goes to environments/image_search_service.py; one `tool`
  message comes back whose content is a list of parts: a text line `[s012] Vorel rainfall (128x128)`
  followed by that slide as an image part (a PIL image), for each of the top-k slides, then a hint
  naming the slide a `<bbox>` would crop. The message also carries the ids as `doc_ids`.
- `<bbox>[x1, y1, x2, y2]</bbox>`: crops the first (top-ranked) slide of the latest search, pixel
  coordinates of that slide (x2, y2 exclusive), each clamped into the image; the crop comes back as
  an image part at its own size. A malformed, inverted or fully outside box, or a bbox before any
  search, gets a tool text message saying what is wrong (the episode goes on; never an exception).
- `<search_complete>true</search_complete>`, or no tag: the episode ends.

`reward_fn` (per sample, as the trainer scores each sample when it finishes):
- Without `<search_complete>true</search_complete>` in the final turn the sample scores 0 with no call
  (as the seed leaves samples that never complete at 0); VSEARCH_REQUIRE_COMPLETE=0 scores them too.
- judge: the frozen generator (any OpenAI-compatible chat endpoint, official `openai` client) gets
  the question and the gathered images (search results and crops, the last GENERATOR_MAX_IMAGES) as
  `image_url` data-URL parts and answers `<answer>...</answer>`; that answer is graded against the
  row's `target` by judge_ndcg.py's judge client (its JUDGE_* settings, text only, as the seed's judge).
- ndcg: judge_ndcg.py's `ndcg_at_k` over the ids the searches showed (in order, each once) against
  the row's `gold_ids`.

Rows (stub/data/visual_search/*.jsonl, written by environments/build_image_corpus.py):
`{"messages": [system, user], "answer": {"target": "412", "gold_ids": ["s000"]}}`.

Settings (environment variables; the env contract passes no config):
  VSEARCH_URL            image service, default http://127.0.0.1:8002
  VSEARCH_TOP_K          slides per search, default 3
  VSEARCH_TIMEOUT_S      per search request, default 10
  VSEARCH_RETRIES        extra attempts after a failed search, default 2 (backoff 0.2 s, doubling)
  VSEARCH_CONCURRENCY    searches in flight per process, default 32
  VSEARCH_NDCG_K         NDCG cut-off, default 3
  VSEARCH_REQUIRE_COMPLETE  1 (default): no search_complete, reward 0 and no call; 0: score every sample
  RM_JUDGE_COEF, RM_NDCG_COEF   the reward's weights (the seed's names), default 0.5, 0.5; 0 skips
                         that part (RM_JUDGE_COEF=0: no generator or judge call)
  GENERATOR_BASE_URL     default http://127.0.0.1:8003/v1     GENERATOR_MODEL  default: the server's first
  GENERATOR_API_KEY      default "none"                       GENERATOR_TIMEOUT_S  per request, default 60
  GENERATOR_MAX_RETRIES  extra attempts, default 2 (backoff GENERATOR_BACKOFF_S=0.5, doubling, jitter)
  GENERATOR_CONCURRENCY  default 16      GENERATOR_MAX_TOKENS  default 128    GENERATOR_TEMPERATURE  default 0
  GENERATOR_MAX_IMAGES   images sent, the latest ones, default 6
  JUDGE_BASE_URL, JUDGE_MODEL, JUDGE_TIMEOUT_S, ...: judge_ndcg.py's (its JUDGE_COEF/NDCG_COEF are not read)
A search, generator or judge call that still fails after its retries raises with what it waited
for (URL, timeout, attempts): the rollout scores that sample `rollout.env_error_reward` and goes
on. Keep `rollout.env_timeout_s` above the worst case of reward_fn, generator + judge attempts
(with the defaults 3 x 60 s + 3 x 20 s + backoff: 300 s is safe).

Metrics: `pop_api_calls` gives the trainer one record per call, logged as `api/<kind>/...` (count,
errors, latency percentiles): `image_search` (HTTP attempts), `crop` (each bbox; an invalid box is an
error record: `api/crop/errors / api/crop/count` is the policy's invalid-bbox rate), `generator` and
`judge`. `pop_reward_stats()` returns the judge / NDCG means since its last call (not read by the
trainer yet: it has no hook for env metrics other than API calls).
"""
from __future__ import annotations

import asyncio
import base64
import io
import math
import os
import random
import re
import sys
import threading

import httpx
import openai
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # judge_ndcg sits next to this file

import judge_ndcg  # noqa: E402
from judge_ndcg import gold_ids, ndcg_at_k, question_of, retrieved_ids, text_of  # noqa: E402
from searchr1 import targets  # noqa: E402

from train.utils.api_stats import ApiCallRecorder, describe  # noqa: E402
from train.utils.http_pool import pool_limits  # noqa: E402

ACTION = re.compile(r"<(search|bbox|search_complete)>(.*?)</\1>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*"
BBOX = re.compile(r"^\s*\[" + ",".join([_NUMBER] * 4) + r"\]\s*$")

GENERATOR_SYSTEM = ("Answer the question from the images. Reply with the answer only, as "
                    "<answer>...</answer>: a number or a few words.")

recorder = ApiCallRecorder()


def pop_api_calls() -> list[dict]:
    return recorder.pop() + judge_ndcg.recorder.pop()


def _setting(name: str, default: str) -> str:
    return os.environ.get(name, default)


class VisualSearchError(RuntimeError):
    """A service (image search, frozen generator, judge) still failing after its retries."""


class BboxError(ValueError):
    """The policy's bbox cannot be cropped; the message is shown to it."""


# ----------------------------------------------------------------------------- message helpers

def last_assistant(messages: list[dict]) -> str:
    return next((text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "assistant"), "")


def parse_action(text: str) -> tuple[str | None, str]:
    """('search' | 'bbox' | 'search_complete', the tag's content) for the turn's first tag, else (None, '')."""
    m = ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


def image_parts(content: object) -> list[dict]:
    if not isinstance(content, list):
        return []
    return [p for p in content if isinstance(p, dict) and p.get("type") in ("image", "image_url")]


def _source(part: dict) -> object:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)


def image_of(part: dict) -> Image.Image:
    """The PIL image of an image part (its `image`, `path` or `url`; `image_url` parts too): a PIL
    image, a file path, or a data URL."""
    src = _source(part)
    if isinstance(src, Image.Image):
        return src
    if not isinstance(src, str):
        raise BboxError(f"the image to crop is a {type(src).__name__}, not an image")
    if src.startswith("data:"):
        return Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
    if src.startswith(("http://", "https://")):
        raise BboxError("the image to crop is a remote URL; only images held in the conversation can be cropped")
    return Image.open(src)


def png_data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def data_url(part: dict) -> str:
    """The part's image as a URL an OpenAI-compatible server takes: data URLs and http(s) URLs as
    they are, PIL images and files as PNG data URLs."""
    src = _source(part)
    if isinstance(src, str) and src.startswith(("data:", "http://", "https://")):
        return src
    return png_data_url(image_of(part))


# -------------------------------------------------------------------------------------- bbox

def parse_bbox(text: str) -> tuple[float, float, float, float]:
    m = BBOX.match(text)
    if not m:
        raise BboxError(f"invalid bbox {text[:80]!r}: write four numbers, <bbox>[x1, y1, x2, y2]</bbox>")
    x1, y1, x2, y2 = (float(v) for v in m.groups())
    if not all(map(math.isfinite, (x1, y1, x2, y2))):  # hundreds of digits parse as inf
        raise BboxError(f"invalid bbox {text.strip()[:80]}: coordinates out of range")
    if x1 >= x2 or y1 >= y2:
        raise BboxError(f"invalid bbox {text.strip()[:80]}: need x1 < x2 and y1 < y2")
    return x1, y1, x2, y2


def clamp_box(box: tuple[float, float, float, float], size: tuple[int, int]) -> tuple[tuple[int, int, int, int], bool]:
    """Integer pixel box (x2, y2 exclusive) inside a `size` image, and whether clamping changed it."""
    w, h = size
    # fractions round outwards (the crop covers the box), then every side is clamped into the image
    x1, y1 = max(0, math.floor(box[0])), max(0, math.floor(box[1]))
    x2, y2 = min(w, math.ceil(box[2])), min(h, math.ceil(box[3]))
    if x1 >= x2 or y1 >= y2:
        raise BboxError(f"bbox [{', '.join(f'{v:g}' for v in box)}] lies outside the {w}x{h} image: nothing to crop")
    return (x1, y1, x2, y2), box[0] < 0 or box[1] < 0 or box[2] > w or box[3] > h


def crop_target(messages: list[dict]) -> tuple[str, dict] | None:
    """(id, image part) of the first slide of the latest search, or None before any search."""
    for m in reversed(messages):
        if m.get("role") != "tool" or not m.get("doc_ids"):
            continue
        parts = image_parts(m.get("content"))
        if parts:
            return str(m["doc_ids"][0]), parts[0]
    return None


def crop_message(messages: list[dict], text: str) -> dict:
    """The tool message for a `<bbox>`: the crop, or what is wrong (BboxError's message)."""
    target = crop_target(messages)
    if target is None:
        raise BboxError("nothing to crop: no slide has been retrieved yet; search first with <search>query</search>")
    sid, part = target
    box = parse_bbox(text)
    image = image_of(part)
    (x1, y1, x2, y2), clamped = clamp_box(box, image.size)
    crop = image.crop((x1, y1, x2, y2))
    crop.load()
    note = f" (clamped to the {image.size[0]}x{image.size[1]} image)" if clamped else ""
    return {"role": "tool", "doc_ids": [], "crop_of": sid, "bbox": [x1, y1, x2, y2],
            "content": [{"type": "text", "text": f"Crop [{x1}, {y1}, {x2}, {y2}] of {sid}{note}, "
                                                 f"{x2 - x1}x{y2 - y1} pixels:"},
                        {"type": "image", "image": crop}]}


# ---------------------------------------------------------------------------- search client

class ImageSearchClient:
    """One pooled httpx.AsyncClient and concurrency limit per event loop (never shared across loops)."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._per_loop: dict[asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, asyncio.Semaphore]] = {}
        self._transport = transport

    def _get(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        for old in [lp for lp in self._per_loop if lp.is_closed()]:
            del self._per_loop[old]  # a closed loop's client can be neither used nor closed
        if loop not in self._per_loop:
            n = int(_setting("VSEARCH_CONCURRENCY", "32"))
            client = httpx.AsyncClient(base_url=_setting("VSEARCH_URL", "http://127.0.0.1:8002").rstrip("/"),
                                       timeout=float(_setting("VSEARCH_TIMEOUT_S", "10")),
                                       limits=pool_limits(n), transport=self._transport)
            self._per_loop[loop] = (client, asyncio.Semaphore(n))
        return self._per_loop[loop]

    async def search(self, query: str, top_k: int | None = None) -> list[dict]:
        client, limit = self._get()
        body = {"query": query, "top_k": top_k or int(_setting("VSEARCH_TOP_K", "3"))}
        retries, delay = int(_setting("VSEARCH_RETRIES", "2")), 0.2
        where, last = f"image search at {client.base_url}/search", ""
        for attempt in range(retries + 1):
            try:
                async with recorder.call("image_search", limit):
                    resp = await client.post("/search", json=body)
                    resp.raise_for_status()
                    return resp.json()["results"]
            except httpx.TimeoutException as e:
                last = (f"no reply within VSEARCH_TIMEOUT_S={_setting('VSEARCH_TIMEOUT_S', '10')} s "
                        f"({type(e).__name__})")
            except httpx.HTTPStatusError as e:
                code = e.response.status_code
                if code < 500 and code != 429:  # asking again will not help
                    raise VisualSearchError(f"{where} refused the query: {code} {e.response.text[:200]}") from e
                last = f"HTTP {code}"
            except httpx.TransportError as e:
                last = describe(e)
            if attempt < retries:
                await asyncio.sleep(delay)
                delay *= 2
        raise VisualSearchError(f"{where} failed after {retries + 1} attempts: {last}")


search_client = ImageSearchClient()


def decode_png(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image.convert("RGB")


async def search_message(query: str) -> dict:
    if not query:
        return {"role": "tool", "doc_ids": [],
                "content": "Empty query: write the query between <search> and </search>."}
    results = await search_client.search(query)
    if not results:
        return {"role": "tool", "doc_ids": [], "content": f"No slides found for {query!r}."}
    parts: list[dict] = []
    for r in results:
        image = decode_png(r["image"])
        parts.append({"type": "text", "text": f"[{r['id']}] {r.get('title', '')} ({image.size[0]}x{image.size[1]})"})
        parts.append({"type": "image", "image": image})
    first = parts[1]["image"]
    parts.append({"type": "text", "text": (
        f"<bbox>[x1, y1, x2, y2]</bbox> crops {results[0]['id']} ({first.size[0]}x{first.size[1]} pixels); "
        "<search_complete>true</search_complete> ends the search.")})
    return {"role": "tool", "content": parts, "doc_ids": [str(r["id"]) for r in results]}


async def interact(messages: list[dict]) -> list[dict]:
    action, content = parse_action(last_assistant(messages))
    if action == "search":
        return [await search_message(content)]
    if action == "bbox":
        try:
            async with recorder.call("crop"):
                return [crop_message(messages, content)]
        except BboxError as e:
            return [{"role": "tool", "doc_ids": [], "content": f"Cannot crop: {e}."}]
        except (OSError, ValueError) as e:  # an unreadable image part (bad file or base64): say so, go on
            return [{"role": "tool", "doc_ids": [], "content": f"Cannot crop: the slide cannot be read ({describe(e)})."}]
    return []


# ----------------------------------------------------------------------------- frozen generator

RETRYABLE = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)  # timeouts included


class GeneratorClient:
    """The frozen generator: one AsyncOpenAI client, limit and model name per event loop."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._per_loop: dict[asyncio.AbstractEventLoop, dict] = {}
        self._transport = transport

    def _get(self) -> dict:
        loop = asyncio.get_running_loop()
        for old in [lp for lp in self._per_loop if lp.is_closed()]:
            del self._per_loop[old]
        if loop not in self._per_loop:
            timeout, n = float(_setting("GENERATOR_TIMEOUT_S", "60")), int(_setting("GENERATOR_CONCURRENCY", "16"))
            http = httpx.AsyncClient(timeout=timeout, transport=self._transport, limits=pool_limits(n))
            client = openai.AsyncOpenAI(base_url=_setting("GENERATOR_BASE_URL", "http://127.0.0.1:8003/v1"),
                                        api_key=_setting("GENERATOR_API_KEY", "none"), timeout=timeout,
                                        max_retries=0, http_client=http)  # retries are ours, counted
            self._per_loop[loop] = {"client": client, "limit": asyncio.Semaphore(n),
                                    "model": _setting("GENERATOR_MODEL", "") or None}
        return self._per_loop[loop]

    @staticmethod
    def request(question: str, urls: list[str]) -> list[dict]:
        parts: list[dict] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        note = "" if urls else " (no images were retrieved)"
        parts.append({"type": "text", "text": f"Question: {question}{note}"})
        return [{"role": "system", "content": GENERATOR_SYSTEM}, {"role": "user", "content": parts}]

    async def answer(self, question: str, images: list[dict]) -> str:
        """The generator's answer (the content of its last <answer>, else its whole reply, stripped)."""
        state = self._get()
        client = state["client"]
        keep = int(_setting("GENERATOR_MAX_IMAGES", "6"))
        urls = [data_url(p) for p in images[-keep:]] if keep > 0 else []
        messages = self.request(question, urls)
        retries = int(_setting("GENERATOR_MAX_RETRIES", "2"))
        backoff = float(_setting("GENERATOR_BACKOFF_S", "0.5"))
        where = f"frozen generator at {client.base_url}"
        last = ""
        for attempt in range(retries + 1):
            try:
                async with recorder.call("generator", state["limit"]):
                    if state["model"] is None:  # ask the server once which model it serves
                        models = await client.models.list()
                        if not models.data:
                            raise VisualSearchError(f"{where} lists no model; set GENERATOR_MODEL")
                        state["model"] = models.data[0].id
                    resp = await client.chat.completions.create(
                        model=state["model"], messages=messages,
                        max_tokens=int(_setting("GENERATOR_MAX_TOKENS", "128")),
                        temperature=float(_setting("GENERATOR_TEMPERATURE", "0")))
                text = resp.choices[0].message.content or ""
                found = ANSWER.findall(text)
                return (found[-1] if found else text).strip()
            except openai.APITimeoutError:
                last = f"no reply within GENERATOR_TIMEOUT_S={_setting('GENERATOR_TIMEOUT_S', '60')} s"
            except RETRYABLE as e:
                last = describe(e)
            except openai.APIStatusError as e:  # other 4xx: asking again will not help
                raise VisualSearchError(f"{where} rejected the request: {describe(e)}") from e
            if attempt < retries:
                await asyncio.sleep(backoff * (2 ** attempt) * (0.5 + random.random()))
        raise VisualSearchError(f"{where} failed after {retries + 1} attempts: {last}")


generator_client = GeneratorClient()


# ------------------------------------------------------------------------------------- reward

def completed(messages: list[dict]) -> bool:
    action, content = parse_action(last_assistant(messages))
    return action == "search_complete" and content.lower() == "true"


def gathered_images(messages: list[dict]) -> list[dict]:
    """Every image part the tool messages showed (search results and crops), in order."""
    return [p for m in messages if m.get("role") == "tool" for p in image_parts(m.get("content"))]


def id_view(messages: list[dict]) -> list[dict]:
    """Tool messages as judge_ndcg.retrieved_ids reads them (text content, `doc_ids` where given)."""
    out = []
    for m in messages:
        if m.get("role") == "tool":
            view = {"role": "tool", "content": text_of(m.get("content"))}
            if "doc_ids" in m:
                view["doc_ids"] = m["doc_ids"]
            out.append(view)
    return out


_stats_lock = threading.Lock()
_stats = {"scored": 0, "incomplete": 0, "judge": 0.0, "ndcg": 0.0}


def _count(**kw: float) -> None:
    with _stats_lock:
        for k, v in kw.items():
            _stats[k] += v


def pop_reward_stats() -> dict[str, float]:
    """Means of the reward's parts over the samples scored since the last call, and their counts."""
    with _stats_lock:
        s = dict(_stats)
        _stats.update(scored=0, incomplete=0, judge=0.0, ndcg=0.0)
    n = s["scored"]
    return {"visual_search/scored": float(n), "visual_search/incomplete": float(s["incomplete"]),
            "visual_search/judge_mean": s["judge"] / n if n else 0.0,
            "visual_search/ndcg_mean": s["ndcg"] / n if n else 0.0}


async def judge_score(question: str, reference: str, candidate: str) -> float:
    try:
        return await judge_ndcg.judge_client.score(question, reference, candidate)
    except judge_ndcg.JudgeError as e:
        raise VisualSearchError(
            f"judge at {_setting('JUDGE_BASE_URL', 'http://127.0.0.1:8001/v1')} "
            f"(JUDGE_TIMEOUT_S={_setting('JUDGE_TIMEOUT_S', '20')} s per attempt): {e}") from e


async def reward_parts(messages: list[dict], answer: object) -> dict[str, float]:
    """{'judge', 'ndcg', 'reward'} of one finished sample (the generator and judge called as needed)."""
    judge_coef = float(_setting("RM_JUDGE_COEF", "0.5"))
    ndcg_coef = float(_setting("RM_NDCG_COEF", "0.5"))
    if _setting("VSEARCH_REQUIRE_COMPLETE", "1") == "1" and not completed(messages):
        _count(incomplete=1)
        return {"judge": 0.0, "ndcg": 0.0, "reward": 0.0}
    judge = 0.0
    if judge_coef:
        question = question_of(messages)
        candidate = await generator_client.answer(question, gathered_images(messages))
        if candidate:
            judge = await judge_score(question, " / ".join(targets(answer)), candidate)
    ndcg = 0.0
    if ndcg_coef:
        ndcg = ndcg_at_k(retrieved_ids(id_view(messages)), gold_ids(answer), int(_setting("VSEARCH_NDCG_K", "3")))
    _count(scored=1, judge=judge, ndcg=ndcg)
    return {"judge": judge, "ndcg": ndcg, "reward": judge_coef * judge + ndcg_coef * ndcg}


async def reward_fn(messages: list[dict], answer: object) -> float:
    return (await reward_parts(messages, answer))["reward"]
