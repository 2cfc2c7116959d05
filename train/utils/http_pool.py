"""Connection-pool limits shared by the env modules' HTTP clients (search, sandbox, judge).

An idle pooled connection is dropped by the client after `IDLE_CLOSE_S`, well before common servers
close it (uvicorn and many proxies close idle keep-alive connections after 5 s). With equal timeouts
both ends close at about the same moment, and a request sent on a connection the server is closing
fails with "Server disconnected without sending a response": a needless error and retry per
connection and idle gap (for instance the gap between rollouts while the trainer updates).
"""
from __future__ import annotations

import httpx

IDLE_CLOSE_S = 2.0


def pool_limits(max_connections: int) -> httpx.Limits:
    """At most `max_connections` open (all of them may stay pooled), idle ones closed after IDLE_CLOSE_S."""
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                        keepalive_expiry=IDLE_CLOSE_S)
