"""Client side of the sandbox, for env modules and toolsets.

`SandboxClient.run(code, stdin, files, run_timeout)` answers a SandboxFusion `RunCodeResponse`
dict. With a URL (`SANDBOX_URL`, e.g. http://127.0.0.1:8080) it posts to a sandbox service
(ours or a real SandboxFusion); without one it runs the same bwrap executor in this process, and
refuses (SandboxUnavailable) if bwrap is missing. Per event loop it keeps one pooled
`httpx.AsyncClient` (or one executor) and one semaphore of `SANDBOX_MAX_CONCURRENCY` slots:
clients and semaphores bind to the loop they were made in, so they are never shared across
loops or threads. Every call is timed by the env module's `ApiCallRecorder` (if given).
"""
from __future__ import annotations

import asyncio
import base64
import os
import sys
import weakref
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # imported from a taskset or an env file: find the sibling executor
from sandbox_exec import Limits, SandboxExecutor, SandboxRequestError, find_bwrap  # noqa: E402

RETRY_STATUS = (502, 503, 504)


class SandboxCallError(RuntimeError):
    """The sandbox could not run the program (service down, queue full after retries, ...):
    an infrastructure failure, not a wrong program."""


class _LoopState:
    def __init__(self, client: SandboxClient):
        self.slots = asyncio.Semaphore(client.max_concurrency)
        self.http = None
        self.executor = None
        if client.url:
            import httpx

            from train.utils.http_pool import pool_limits

            self.http = httpx.AsyncClient(
                base_url=client.url,
                limits=pool_limits(client.max_concurrency),
                timeout=httpx.Timeout(client.request_timeout_s, connect=10.0))
        else:
            self.executor = SandboxExecutor(client.limits, client.max_concurrency)


class SandboxClient:
    def __init__(self, url: str | None = None, *, max_concurrency: int | None = None, recorder=None,
                 kind: str = "sandbox", limits: Limits | None = None, retries: int = 3,
                 request_timeout_s: float = 300.0):
        env_url = os.environ.get("SANDBOX_URL", "").strip()
        self.url = (url if url is not None else env_url).rstrip("/") or None
        self.max_concurrency = int(max_concurrency or os.environ.get("SANDBOX_MAX_CONCURRENCY", 8))
        self.recorder, self.kind = recorder, kind
        self.limits = limits or Limits()
        self.retries = retries
        self.request_timeout_s = request_timeout_s
        if self.url is None:
            find_bwrap()  # no service and no bwrap: refuse now, with the install hint
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            state = self._loops[loop] = _LoopState(self)
        return state

    async def run(self, code: str, stdin: str | None = None, files: dict[str, bytes] | None = None,
                  run_timeout: float = 10.0) -> dict[str, Any]:
        state = self._state()
        if self.recorder is None:
            async with state.slots:
                return await self._run(state, code, stdin, files, run_timeout)
        async with self.recorder.call(self.kind, state.slots):
            return await self._run(state, code, stdin, files, run_timeout)

    async def _run(self, state: _LoopState, code: str, stdin: str | None, files: dict[str, bytes] | None,
                   run_timeout: float) -> dict[str, Any]:
        if state.executor is not None:
            try:
                result = await state.executor.run(code, stdin, files, run_timeout)
            except SandboxRequestError as e:
                raise SandboxCallError(str(e)) from e
            run = {k: v for k, v in result.to_dict().items() if k not in ("reason", "files")}
            if result.reason == "sandbox_error":
                return {"status": "SandboxError", "message": result.stderr[:2000], "run_result": run}
            ok = result.status == "Finished" and result.return_code == 0
            return {"status": "Success" if ok else "Failed", "message": result.reason, "run_result": run}
        payload = {"code": code, "language": "python", "stdin": stdin, "run_timeout": run_timeout,
                   "files": {k: base64.b64encode(v).decode() for k, v in (files or {}).items()}}
        import httpx

        delay = 0.5
        for attempt in range(self.retries + 1):
            try:
                resp = await state.http.post("/run_code", json=payload)
            except httpx.TransportError as e:
                error = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code == 200:
                    body = resp.json()
                    if body.get("status") == "SandboxError":
                        raise SandboxCallError(f"sandbox error: {body.get('message', '')[:500]}")
                    return body
                error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                if resp.status_code not in RETRY_STATUS:
                    break
            if attempt < self.retries:
                await asyncio.sleep(delay)
                delay *= 2
        raise SandboxCallError(f"sandbox at {self.url} failed: {error}")

    async def aclose(self) -> None:
        """Close this loop's HTTP pool (other loops keep theirs)."""
        state = self._loops.pop(asyncio.get_running_loop(), None)
        if state is not None and state.http is not None:
            await state.http.aclose()
