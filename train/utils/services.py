"""Local services started as processes (a search index, a judge, an image service): start them, wait until
each health URL answers 200, stop them afterwards. Tests, benchmarks and build scripts share this one loop."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path


class ServiceError(RuntimeError):
    """A service exited before it was healthy, or was not healthy in time; the message holds its log's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a service or a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """Terminate a process (kill it after 15 s) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_all(commands: Mapping[str, tuple[list[str], str, Path]], *, timeout: float = 180.0,
                env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                ) -> Iterator[dict[str, subprocess.Popen]]:
    """Start every command (name -> (argv, health URL, log file)) at once, so they load side by side, wait until
    each health URL answers 200 (ServiceError naming the service and its log's tail if one exits first or the
    `timeout` passes), yield the processes by name, and stop them all afterwards."""
    import httpx

    procs: dict[str, subprocess.Popen] = {}
    files = []
    try:
        for name, (cmd, _, log) in commands.items():
            files.append(open(log, "w"))
            procs[name] = subprocess.Popen(cmd, cwd=cwd, stdout=files[-1], stderr=subprocess.STDOUT,
                                           env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        waiting = dict(commands)
        while waiting:
            for name, (_, health, log) in list(waiting.items()):
                if procs[name].poll() is not None:
                    raise ServiceError(f"{name} exited with {procs[name].returncode}:\n{Path(log).read_text()[-3000:]}")
                try:
                    if httpx.get(health, timeout=2).status_code == 200:
                        del waiting[name]
                except httpx.TransportError:
                    pass
            if waiting and time.monotonic() > deadline:
                tails = "\n".join(f"{n}: {Path(log).read_text()[-3000:]}" for n, (_, _, log) in waiting.items())
                raise ServiceError(f"{', '.join(sorted(waiting))} not healthy after {timeout}s:\n{tails}")
            if waiting:
                time.sleep(0.3)
        yield procs
    finally:
        for proc in procs.values():
            stop(proc)
        for f in files:
            f.close()
