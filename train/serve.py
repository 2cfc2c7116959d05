"""An OpenAI-compatible model server over the project's `hf` engine.

    python -m train.serve --model runs/stub/latest --port 8001 [--host 127.0.0.1] [--served-model-name NAME]

so a trained policy (any `latest/` folder) or any local HF model can be queried with the official
`openai` client, and so an LLM judge has a real endpoint offline:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8001/v1", api_key="none")
    client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "2 + 3"}])

Endpoints: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions` (also `stream=true`,
sent as server-sent events once the reply is complete), `GET /health`.
Supported request fields: messages, max_tokens / max_completion_tokens, temperature, top_p, top_k,
n, stop, seed, logprobs (of the sampled tokens), stream, stream_options.include_usage. Concurrent
requests are batched by the engine. What the engine cannot do is refused with a 400 in OpenAI's
error format rather than ignored: `response_format` json_object/json_schema (no constrained
decoding), `tools`, `top_logprobs`, non-zero penalties and `logit_bias`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from typing import Annotated, Any

from fastapi import Body, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from train.datasets.tokenize import prompt_ids
from train.engines.base import Generation, SamplingParams


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are ignored, like most servers do

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def message_text(content: Any) -> str:
    """OpenAI content: a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, "only text content parts are supported", "messages")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ApiError(400, "message content must be a string or a list of text parts", "messages")


def check_supported(req: ChatRequest) -> None:
    fmt = (req.response_format or {}).get("type", "text")
    if fmt != "text":
        raise ApiError(400, f"response_format type '{fmt}' is not supported by train.serve (no constrained "
                            "decoding): ask for JSON in the prompt instead", "response_format")
    if req.tools:
        raise ApiError(400, "tools are not supported by train.serve", "tools")
    if req.top_logprobs:
        raise ApiError(400, "top_logprobs is not supported (logprobs of the sampled tokens are)", "top_logprobs")
    if req.presence_penalty or req.frequency_penalty or req.logit_bias:
        raise ApiError(400, "penalties and logit_bias are not supported by train.serve", "presence_penalty")
    if not req.messages:
        raise ApiError(400, "messages must not be empty", "messages")


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """OpenAI semantics: the reply ends before the first stop string, which is not returned."""
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class ModelServer:
    def __init__(self, engine: Any, tokenizer: Any, served_name: str, model_path: str,
                 max_new_tokens: int = 512, api_key: str | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.served_name, self.model_path = served_name, model_path
        self.max_new_tokens, self.api_key = max_new_tokens, api_key
        self.max_positions: int | None = getattr(engine, "max_positions", None)
        self.created = int(time.time())
        self.eos_ids = set(getattr(engine, "eos_token_ids", ()) or ())

    def model_card(self) -> dict:
        return {"id": self.served_name, "object": "model", "created": self.created, "owned_by": "infinite-rl",
                "root": self.model_path, "max_model_len": self.max_positions}

    def check_auth(self, authorization: str | None) -> None:
        if self.api_key and authorization != f"Bearer {self.api_key}":
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key", kind="authentication_error")

    def decode(self, gen: Generation) -> str:
        ids = list(gen.token_ids)
        if ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def logprobs_of(self, gen: Generation) -> dict:
        content = []
        for tid, lp in zip(gen.token_ids, gen.logprobs):
            token = self.tokenizer.decode([tid])
            content.append({"token": token, "logprob": float(lp), "bytes": list(token.encode()), "top_logprobs": []})
        return {"content": content}

    async def complete(self, req: ChatRequest) -> dict:
        check_supported(req)
        if req.model not in (self.served_name, self.model_path):
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves '{self.served_name}'",
                           "model", "model_not_found")
        messages = [{"role": str(m.get("role", "user")), "content": message_text(m.get("content"))}
                    for m in req.messages]
        ids = prompt_ids(self.tokenizer, messages)
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {self.max_positions}",
                           "messages", "context_length_exceeded")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        max_new = req.max_completion_tokens or req.max_tokens or self.max_new_tokens
        params = [SamplingParams(max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
                                 top_k=req.top_k, stop=tuple(stops),
                                 seed=None if req.seed is None else req.seed + i) for i in range(req.n)]
        gens = await asyncio.gather(*(self.engine.generate(ids, p) for p in params))
        choices = []
        for i, gen in enumerate(gens):
            text, stopped = cut_at_stop(self.decode(gen), stops)
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop" if stopped else gen.finish_reason,
                            "logprobs": self.logprobs_of(gen) if req.logprobs else None})
        completion = sum(len(g.token_ids) for g in gens)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.served_name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                          "total_tokens": len(ids) + completion}}


def sse_events(result: dict, include_usage: bool) -> list[str]:
    """A complete reply as chat.completion.chunk events: role, content, finish, [usage], [DONE]."""
    base = {"id": result["id"], "object": "chat.completion.chunk", "created": result["created"],
            "model": result["model"]}
    events = []
    for c in result["choices"]:
        i = c["index"]
        for delta, finish in (({"role": "assistant", "content": ""}, None),
                              ({"content": c["message"]["content"]}, None), ({}, c["finish_reason"])):
            choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
            if finish is None and "role" not in delta and c["logprobs"] is not None:
                choice["logprobs"] = c["logprobs"]
            events.append({**base, "choices": [choice]})
    if include_usage:
        events.append({**base, "choices": [], "usage": result["usage"]})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]


def create_app(server: ModelServer) -> FastAPI:
    app = FastAPI(title="infinite-rl model server")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return ApiError(400, f"invalid request: {first.get('msg', exc)} ({param})", param).response()

    @app.exception_handler(ValueError)
    async def engine_refused(_: Request, exc: ValueError):  # the engine's own request checks
        return ApiError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception):  # clients still get OpenAI's error shape
        return ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.served_name}

    @app.get("/v1/models")
    async def models(authorization: Annotated[str | None, Header()] = None):
        server.check_auth(authorization)
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, authorization: Annotated[str | None, Header()] = None):
        server.check_auth(authorization)
        if model_id not in (server.served_name, server.model_path):
            raise ApiError(404, f"model '{model_id}' does not exist", "model", "model_not_found")
        return server.model_card()

    @app.post("/v1/chat/completions")
    async def chat(req: Annotated[ChatRequest, Body()], authorization: Annotated[str | None, Header()] = None):
        server.check_auth(authorization)
        result = await server.complete(req)
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(iter(sse_events(result, include_usage)), media_type="text/event-stream")
        return result

    return app


def build_server(args: argparse.Namespace) -> ModelServer:
    import torch
    from transformers import AutoTokenizer

    from train.engines.hf import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if args.chat_template:
        with open(args.chat_template) as f:
            tokenizer.chat_template = f.read()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    engine = HFEngine.from_pretrained(args.model, tokenizer, dtype=getattr(torch, args.dtype), device=device,
                                      max_batch_size=args.max_batch_size, seed=args.seed)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return ModelServer(engine, tokenizer, name, args.model, max_new_tokens=args.max_new_tokens,
                       api_key=args.api_key or os.environ.get("SERVE_API_KEY"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.serve", description="OpenAI-compatible server over the hf engine")
    p.add_argument("--model", required=True, help="local HF model folder (e.g. a run's latest/)")
    p.add_argument("--tokenizer", default=None, help="default: --model")
    p.add_argument("--chat-template", default=None, help="Jinja file that replaces the tokenizer's template")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: folder name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences per engine forward")
    p.add_argument("--max-new-tokens", type=int, default=512, help="when a request gives no max_tokens")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="for requests without a seed")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (or set SERVE_API_KEY)")
    args = p.parse_args(argv)

    import uvicorn

    server = build_server(args)
    print(f"serving {args.model} as '{server.served_name}' on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
