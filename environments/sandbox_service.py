"""A code sandbox service speaking SandboxFusion's `/run_code` API, backed by bubblewrap.

    python environments/sandbox_service.py --port 8080 --max-concurrency 4

`POST /run_code` takes SandboxFusion's `RunCodeRequest` (`code`, `language` = python, `stdin`,
`run_timeout`, `files` = {path: base64}) and answers its `RunCodeResponse` (`status` Success /
Failed / SandboxError, `message`, `run_result` = {status, return_code, stdout, stderr,
execution_time}), so the official `sandbox-fusion` client works against it unmodified.
`GET /health` reports the load. Each program runs under bwrap with the limits of
`sandbox_exec.Limits` (see that module for what the sandbox allows); at most `--max-concurrency`
run at once, up to `--max-queue` more wait their turn, and further requests get HTTP 503 (the
SandboxFusion client retries those). Without a working bwrap the service refuses to start.
It listens on 127.0.0.1 by default: it runs arbitrary code, so never expose it without thinking.

Request limits: a body over `--max-request-bytes` is refused with HTTP 413 and never kept in memory
(its Content-Length is checked first, the bytes as they arrive otherwise); `stdin` over
`--max-stdin-bytes` and files over the sandbox's total are 413 too; a body that has not fully
arrived `--body-timeout-s` after the request's headers is answered 408 (a slow client cannot hold
a connection and its buffer open). Idle keep-alive connections close after uvicorn's
`timeout_keep_alive` (5 s). `run_timeout` and `compile_timeout` must be finite and positive (422).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import json
import os
import sys
import time
from typing import Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # run as a script: find the sibling executor
from sandbox_exec import (Limits, SandboxExecutor, SandboxRequestError,  # noqa: E402
                          SandboxRequestTooLarge, SandboxUnavailable, find_bwrap)

PYTHON_LANGUAGES = ("python", "python3")
# HTTP limits (the sandbox's own are in sandbox_exec.Limits). A request at the sandbox's limits
# (8 MiB stdin, 16 MiB of files, base64: 21.4 MiB) fits in the default body size.
MAX_REQUEST_BYTES = 32 << 20  # --max-request-bytes
BODY_TIMEOUT_S = 30.0  # --body-timeout-s
KEEP_ALIVE_S = 5  # uvicorn's timeout_keep_alive: idle connections are closed after it


class RunCodeRequest(BaseModel):
    code: str
    language: str = "python"
    stdin: Optional[str] = None
    run_timeout: float = Field(default=10.0, gt=0, allow_inf_nan=False)  # seconds; NaN, inf, <= 0: a 422
    compile_timeout: float = Field(default=10.0, gt=0, allow_inf_nan=False)  # accepted; Python has no compile step
    files: dict[str, Optional[str]] = Field(default_factory=dict)  # path -> base64 content
    fetch_files: list[str] = Field(default_factory=list)


class CommandRunResult(BaseModel):
    status: str  # Finished | Error | TimeLimitExceeded
    execution_time: Optional[float] = None
    return_code: Optional[int] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None


class RunCodeResponse(BaseModel):
    status: str  # Success | Failed | SandboxError
    message: str = ""
    compile_result: Optional[CommandRunResult] = None
    run_result: Optional[CommandRunResult] = None
    executor_pod_name: Optional[str] = None
    files: dict[str, str] = Field(default_factory=dict)


class BodyLimits:
    """ASGI middleware: a request body over `max_bytes` is answered 413 (its Content-Length is
    checked first, the bytes as they arrive otherwise) and is never held in memory; one that has not
    fully arrived `timeout_s` after the headers is answered 408. The rest of a refused body is read
    and dropped before the answer (until the deadline): a client still uploading when the server
    closes on it gets a connection reset instead of the 413."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    def too_large(self, size: int | str) -> HTTPException:
        return HTTPException(413, f"request body of {size} bytes is over this service's limit of {self.max_bytes} "
                                  "bytes (--max-request-bytes): send less stdin or smaller files")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = time.monotonic() + self.timeout_s
        received, complete, started = 0, False, False

        async def next_message() -> Message:
            try:
                return await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.timeout_s:g} s "
                                         "(--body-timeout-s)") from None

        async def drain() -> None:  # drop the rest of a refused body, until the deadline at most
            nonlocal complete
            try:
                while not complete:
                    message = await next_message()
                    complete = message["type"] != "http.request" or not message.get("more_body", False)
            except HTTPException:
                pass

        async def limited_receive() -> Message:
            nonlocal received, complete
            if complete:  # the body is in: later reads wait for a disconnect, without a deadline
                return await receive()
            message = await next_message()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_bytes:
                    await drain()
                    raise self.too_large(f"more than {self.max_bytes}")
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await drain()
            return await self.reply(send, self.too_large(int(length)))
        try:
            await self.app(scope, limited_receive, tracked_send)
        except HTTPException as e:  # raised by limited_receive outside a route (FastAPI answers those inside)
            if started:
                raise
            await self.reply(send, e)

    @staticmethod
    async def reply(send: Send, error: HTTPException) -> None:
        body = json.dumps({"detail": error.detail}).encode()
        await send({"type": "http.response.start", "status": error.status_code,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(limits: Limits, max_concurrency: int, max_queue: int = 1024,
               max_request_bytes: int = MAX_REQUEST_BYTES, body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    app = FastAPI(title="Infinite RL sandbox", version="1")
    app.add_middleware(BodyLimits, max_bytes=max_request_bytes, timeout_s=body_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's 422 without the offending input: echoing it back could be huge or not JSON (NaN).
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    # One executor per app, created lazily inside uvicorn's event loop (its semaphore binds to it).
    # A long-running service reaps every sandbox it starts, orphans included (reap_orphans).
    state: dict[str, SandboxExecutor] = {}

    def executor() -> SandboxExecutor:
        if "executor" not in state:
            state["executor"] = SandboxExecutor(limits, max_concurrency, reap_orphans=True)
        return state["executor"]

    @app.get("/health")
    async def health() -> dict:
        ex = executor()
        return {"status": "ok", "running": ex.running, "queued": ex.waiting,
                "max_concurrency": ex.max_concurrency, "max_queue": max_queue, "bwrap": ex.bwrap}

    @app.post("/run_code", response_model=RunCodeResponse, response_model_exclude_none=False)
    async def run_code(req: RunCodeRequest) -> RunCodeResponse:
        if req.language not in PYTHON_LANGUAGES:
            return RunCodeResponse(status="SandboxError",
                                   message=f"language {req.language!r} is not supported (python only)")
        ex = executor()
        if ex.waiting >= max_queue:
            raise HTTPException(503, f"sandbox queue full ({max_queue} waiting); retry later")
        try:
            files = {name: base64.b64decode(data or "", validate=True) for name, data in req.files.items()}
        except (binascii.Error, ValueError) as e:
            raise HTTPException(400, f"files must be base64: {e}") from None
        try:
            result = await ex.run(req.code, req.stdin, files, req.run_timeout)
        except SandboxRequestTooLarge as e:
            raise HTTPException(413, str(e)) from None
        except SandboxRequestError as e:
            raise HTTPException(400, str(e)) from None
        run = CommandRunResult(status=result.status, execution_time=result.execution_time,
                               return_code=result.return_code, stdout=result.stdout, stderr=result.stderr)
        if result.reason == "sandbox_error":
            return RunCodeResponse(status="SandboxError", message=result.stderr.strip()[:2000], run_result=run)
        ok = result.status == "Finished" and result.return_code == 0
        message = {"timeout": "wall-clock timeout", "cpu_time": "CPU time limit",
                   "output_limit": "output limit exceeded"}.get(result.reason, "")
        if req.fetch_files:
            message = (message + "; " if message else "") + "fetch_files is not supported"
        return RunCodeResponse(status="Success" if ok else "Failed", message=message, run_result=run)

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = Limits()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-concurrency", type=int, default=os.cpu_count() or 1,
                   help="programs running at once (default: CPU cores)")
    p.add_argument("--max-queue", type=int, default=1024, help="requests waiting beyond that get HTTP 503")
    p.add_argument("--cpu-s", type=int, default=d.cpu_s, help="CPU seconds per process")
    p.add_argument("--memory-mb", type=int, default=d.memory_mb, help="address space per process")
    p.add_argument("--max-processes", type=int, default=d.max_processes)
    p.add_argument("--max-output-bytes", type=int, default=d.max_output_bytes, help="stdout/stderr cap, each")
    p.add_argument("--tmp-mb", type=int, default=d.tmp_mb, help="size of the private /tmp")
    p.add_argument("--max-timeout-s", type=float, default=d.max_timeout_s, help="largest run_timeout honoured")
    p.add_argument("--max-stdin-bytes", type=int, default=d.max_stdin_bytes,
                   help="largest stdin (UTF-8); more is a 413")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="largest request body; more is a 413 (dropped as it arrives, never kept)")
    p.add_argument("--body-timeout-s", type=float, default=BODY_TIMEOUT_S,
                   help="a request body must arrive within this many seconds of its headers (else 408)")
    p.add_argument("--uid", type=int, default=d.uid, help="uid to run as when started as root")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    limits = Limits(cpu_s=args.cpu_s, memory_mb=args.memory_mb, max_processes=args.max_processes,
                    max_output_bytes=args.max_output_bytes, tmp_mb=args.tmp_mb,
                    max_timeout_s=args.max_timeout_s, max_stdin_bytes=args.max_stdin_bytes, uid=args.uid)
    try:
        find_bwrap()
        # refuse to start rather than run code unsandboxed; this process reaps the probe's sandbox too
        SandboxExecutor(limits, 1, reap_orphans=True).check()
    except SandboxUnavailable as e:
        print(f"sandbox_service: refusing to start: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    import uvicorn

    print(f"sandbox_service: listening on http://{args.host}:{args.port} "
          f"(max concurrency {args.max_concurrency})", flush=True)
    app = create_app(limits, args.max_concurrency, args.max_queue, args.max_request_bytes, args.body_timeout_s)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
