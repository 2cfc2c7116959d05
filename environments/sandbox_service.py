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
"""
from __future__ import annotations

import argparse
import base64
import binascii
import os
import sys
from typing import Optional

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # run as a script: find the sibling executor
from sandbox_exec import (Limits, SandboxExecutor, SandboxRequestError,  # noqa: E402
                          SandboxUnavailable, find_bwrap)

PYTHON_LANGUAGES = ("python", "python3")


class RunCodeRequest(BaseModel):
    code: str
    language: str = "python"
    stdin: Optional[str] = None
    run_timeout: float = 10.0
    compile_timeout: float = 10.0  # accepted for compatibility; Python has no compile step
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


def create_app(limits: Limits, max_concurrency: int, max_queue: int = 1024) -> FastAPI:
    app = FastAPI(title="Infinite RL sandbox", version="1")
    # One executor per app, created lazily inside uvicorn's event loop (its semaphore binds to it).
    state: dict[str, SandboxExecutor] = {}

    def executor() -> SandboxExecutor:
        if "executor" not in state:
            state["executor"] = SandboxExecutor(limits, max_concurrency)
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
    p.add_argument("--uid", type=int, default=d.uid, help="uid to run as when started as root")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    limits = Limits(cpu_s=args.cpu_s, memory_mb=args.memory_mb, max_processes=args.max_processes,
                    max_output_bytes=args.max_output_bytes, tmp_mb=args.tmp_mb,
                    max_timeout_s=args.max_timeout_s, uid=args.uid)
    try:
        find_bwrap()
        SandboxExecutor(limits, 1).check()  # refuse to start rather than run code unsandboxed
    except SandboxUnavailable as e:
        print(f"sandbox_service: refusing to start: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    import uvicorn

    print(f"sandbox_service: listening on http://{args.host}:{args.port} "
          f"(max concurrency {args.max_concurrency})", flush=True)
    uvicorn.run(create_app(limits, args.max_concurrency, args.max_queue), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
