"""An OpenAI-compatible model server over the project's `hf` engine.

    .venv/bin/python -m train.serve --model runs/stub/latest --port 8001 [--host 127.0.0.1]
        [--served-model-name NAME [ALIAS ...]]

so a trained policy (any `latest/` folder) or any local HF model can be queried with the official
`openai` client, and so an LLM judge has a real endpoint offline:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8001/v1", api_key="none")
    client.chat.completions.create(model="default", messages=[{"role": "user", "content": "2 + 3"}])

The model is served as `default` whatever its folder is called (`latest`, `adapter`, ...), as vLLM's
`--served-model-name` names it apart from its path; `--served-model-name A B` serves it as `A` and
also accepts `B`. The `--model` path and its folder's name are accepted too (what clients used before).

Endpoints: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions` (also `stream=true`,
sent as server-sent events once the reply is complete), `GET /health`.
Supported request fields: messages, max_tokens / max_completion_tokens, temperature, top_p, top_k,
n, stop, seed, logprobs (of the sampled tokens), stream, stream_options.include_usage. Concurrent
requests are batched by the engine. What the engine cannot do is refused with a 400 in OpenAI's
error format rather than ignored: `response_format` json_object/json_schema (no constrained
decoding), `tools`, `top_logprobs`, non-zero penalties and `logit_bias`.

Each request is checked on its own before it joins an engine batch (numbers in range and finite,
the prompt within `--max-prompt-chars` characters and, once tokenized, within the model's context
together with `max_tokens`), so a bad request gets its own 400 and never fails the others. The chat
template and the tokenizer run in a worker thread, so a long prompt does not stall the event loop.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import Body, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from train.datasets.tokenize import prompt_ids
from train.engines.base import Generation, SamplingParams

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
DEFAULT_MAX_PROMPT_CHARS = 1_000_000  # --max-prompt-chars
DEFAULT_SERVED_NAME = "default"  # --served-model-name: the same for a full export and an adapter folder


class ChatRequest(BaseModel):
    # Unknown OpenAI fields are ignored, like most servers do; NaN/Infinity (Python's json accepts
    # them) are refused. The bounds keep every value within what the engine's tensors hold, so a
    # request is refused alone here instead of failing the engine batch it would have joined.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=INT32_MAX)  # -1 or 0: off
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # torch generators take 64 bits
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


def message_text(content: Any, images: bool = False) -> str | list[dict]:
    """OpenAI content: a string or a list of parts; text parts, and with `images` (a vision-language model)
    image_url parts holding data: URLs (a server never reads its own files for a client), kept as parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if images and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            for part in content:
                url = part.get("image_url") if isinstance(part, dict) else None
                url = url.get("url") if isinstance(url, dict) else url
                if isinstance(part, dict) and part.get("type") == "image_url" and not str(url).startswith("data:"):
                    raise ApiError(400, "image_url parts must hold data: URLs (base64); this server does not fetch "
                                        "URLs or read files", "messages")
                if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
                    raise ApiError(400, "content parts must be text or image_url", "messages")
            return content
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, "only text content parts are supported" + (
                    "" if images else " (this model has no vision tower)"), "messages")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ApiError(400, "message content must be a string or a list of text parts", "messages")


def text_chars(content: str | list[dict]) -> int:
    """Characters of a message's text (image parts count by their own budget: the image processor's pixels)."""
    if isinstance(content, str):
        return len(content)
    return sum(len(str(p.get("text", ""))) for p in content if p.get("type") == "text")


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
                 max_new_tokens: int = 512, api_key: str | None = None,
                 max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS, aliases: tuple[str, ...] = (),
                 vision: Any = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.vision = vision  # a vision-language model's VisionProcessor (train/datasets/vision.py); None: text
        self.served_name, self.model_path = served_name, model_path
        # Names a request may give: the served name (listed, and in every reply), the path, the aliases.
        self.accepted = list(dict.fromkeys([served_name, model_path, *aliases]))
        self.max_new_tokens, self.api_key = max_new_tokens, api_key
        self.max_prompt_chars = max_prompt_chars
        self.max_positions: int | None = getattr(engine, "max_positions", None)
        self.created = int(time.time())
        self.eos_ids = set(getattr(engine, "eos_token_ids", ()) or ())
        # Chat template + tokenizer off the event loop; one thread, so the tokenizer is never used
        # by two threads at once (and a long prompt holds one core, not all of them).
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

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

    def completion_budget(self, prompt_tokens: int, req: ChatRequest) -> int:
        """max_tokens for the engine; a prompt, or prompt + asked-for max_tokens, past the model's
        context is a 400 (OpenAI's context_length_exceeded). Without max_tokens the reply may use
        what is left of the context, up to --max-new-tokens."""
        asked = req.max_completion_tokens or req.max_tokens
        if self.max_positions is None:
            return asked or self.max_new_tokens
        room = self.max_positions - prompt_tokens
        if room < 1:
            raise ApiError(400, f"this model's maximum context length is {self.max_positions} tokens; the "
                                f"messages have {prompt_tokens}: shorten them", "messages", "context_length_exceeded")
        if asked is not None and asked > room:
            param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            raise ApiError(400, f"this model's maximum context length is {self.max_positions} tokens; the request "
                                f"asks for {prompt_tokens + asked} ({prompt_tokens} in the messages, {asked} in the "
                                f"completion): lower {param} to at most {room} or shorten the messages",
                           param, "context_length_exceeded")
        return min(asked or self.max_new_tokens, room)

    def prompt(self, messages: list[dict]) -> tuple[list[int], list]:
        """The prompt's token ids and (a vision-language model) its processed images; a bad image is a 400."""
        images: list = []
        if self.vision is not None:
            from train.datasets.vision import ImageError

            try:
                messages, images = self.vision.prepare(messages, "the request")
            except ImageError as e:
                raise ApiError(400, str(e), "messages") from None
        return prompt_ids(self.tokenizer, messages), images

    async def complete(self, req: ChatRequest) -> dict:
        check_supported(req)
        if req.model not in self.accepted:
            also = ", ".join(repr(n) for n in self.accepted[1:])
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves '{self.served_name}'"
                                + (f" (also accepted: {also})" if also else ""), "model", "model_not_found")
        messages = [{"role": str(m.get("role", "user")), "content": message_text(m.get("content"), self.vision is not None)}
                    for m in req.messages]
        chars = sum(len(m["role"]) + text_chars(m["content"]) for m in messages)
        if chars > self.max_prompt_chars:  # before tokenizing: costs nothing
            raise ApiError(400, f"the messages hold {chars} characters; this server accepts at most "
                                f"{self.max_prompt_chars} (--max-prompt-chars): shorten the prompt",
                           "messages", "string_above_max_length")
        loop = asyncio.get_running_loop()
        ids, images = await loop.run_in_executor(self._tokenize_pool, self.prompt, messages)
        max_new = self.completion_budget(len(ids), req)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        # Choice i samples with seed + i, wrapped into the 64 bits a torch generator takes.
        params = [SamplingParams(max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
                                 top_k=req.top_k, stop=tuple(stops),
                                 seed=None if req.seed is None else (req.seed + i) % 2**64) for i in range(req.n)]
        gens = await asyncio.gather(*(self.engine.generate(ids, p, images=images) if images
                                      else self.engine.generate(ids, p) for p in params))
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
        if model_id not in server.accepted:
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
    from train.parallel.distributed import run_device_type

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if args.chat_template:
        with open(args.chat_template) as f:
            tokenizer.chat_template = f.read()
    device = args.device or run_device_type()
    if device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    engine = HFEngine.from_pretrained(args.model, tokenizer, dtype=getattr(torch, args.dtype), device=device,
                                      max_batch_size=args.max_batch_size, seed=args.seed)
    # A stable name, not the folder's: `latest` and `latest/adapter` are both served as `default`, so a
    # client's `model=` does not change with how the model was exported. The folder name is still accepted.
    names = args.served_model_name or [DEFAULT_SERVED_NAME]
    aliases = (*names[1:], os.path.basename(os.path.normpath(args.model)))
    from transformers import AutoConfig

    from train.datasets.vision import VisionProcessor
    from train.models.vlm import is_vision_config

    from train.models.lora import base_model_of

    # an adapter folder (latest/adapter) has no config.json: its base model's says what the model is
    config = AutoConfig.from_pretrained(base_model_of(args.model) or args.model)
    vision = VisionProcessor.from_pretrained(args.model, tokenizer, config) if is_vision_config(config) else None
    return ModelServer(engine, tokenizer, names[0], args.model, max_new_tokens=args.max_new_tokens,
                       api_key=args.api_key or os.environ.get("SERVE_API_KEY"),
                       max_prompt_chars=args.max_prompt_chars, aliases=aliases, vision=vision)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.serve", description="OpenAI-compatible server over the hf engine")
    p.add_argument("--model", required=True, help="local HF model folder (e.g. a run's latest/)")
    p.add_argument("--tokenizer", default=None, help="default: --model")
    p.add_argument("--chat-template", default=None, help="Jinja file that replaces the tokenizer's template")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help=f"the `model` clients send (default: {DEFAULT_SERVED_NAME!r}); more names are accepted too")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences per engine forward")
    p.add_argument("--max-new-tokens", type=int, default=512, help="when a request gives no max_tokens")
    p.add_argument("--max-prompt-chars", type=int, default=DEFAULT_MAX_PROMPT_CHARS,
                   help="longest prompt (characters of all messages), checked before tokenizing; longer is a 400")
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
