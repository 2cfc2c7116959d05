"""The env modules' HTTP clients drop an idle connection before the server would (see
train/utils/http_pool.py): otherwise a request sent as the server closes fails for nothing."""
from __future__ import annotations

import asyncio

from conftest import ROOT, load_file
from train.utils.http_pool import IDLE_CLOSE_S


def _idle_close_s(http) -> float:
    return http._transport._pool._keepalive_expiry  # httpx -> httpcore pool


def test_env_clients_close_idle_connections_before_the_services_do(monkeypatch):
    service = load_file(ROOT / "environments" / "sandbox_service.py")
    assert IDLE_CLOSE_S < service.KEEP_ALIVE_S
    search = load_file(ROOT / "environments" / "searchr1.py")
    judge = load_file(ROOT / "environments" / "judge_ndcg.py")
    sandbox = load_file(ROOT / "environments" / "sandbox_client.py")

    async def pools():
        search_http = search.SearchClient()._get()[0]
        judge_http = judge._LoopJudge().http
        sandbox_http = sandbox._LoopState(sandbox.SandboxClient("http://127.0.0.1:9")).http
        out = [_idle_close_s(h) for h in (search_http, judge_http, sandbox_http)]
        for h in (search_http, judge_http, sandbox_http):
            await h.aclose()
        return out

    assert asyncio.run(pools()) == [IDLE_CLOSE_S] * 3
