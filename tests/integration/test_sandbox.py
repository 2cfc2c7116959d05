"""The sandbox service, for real: started on 127.0.0.1 from its documented command, driven with the
official `sandbox-fusion` client and raw HTTP, attacked, loaded, and stopped."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import ROOT, free_port
SECRET = "s3cr3t-token-that-must-not-leak"
MAX_CONCURRENCY = 2


def start_service(max_concurrency: int = MAX_CONCURRENCY, extra_env: dict | None = None,
                  args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`python environments/sandbox_service.py --port P --max-concurrency N`, waited for /health."""
    port = free_port()
    env = {**os.environ, "SANDBOX_TEST_SECRET": SECRET, **(extra_env or {})}
    proc = subprocess.Popen([sys.executable, "environments/sandbox_service.py", "--port", str(port),
                             "--max-concurrency", str(max_concurrency), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"service exited ({proc.returncode}): {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_service(proc)
    raise AssertionError("service did not become healthy in 60 s")


def stop_service(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def service_proc():
    proc, url = start_service()
    yield proc, url
    stop_service(proc)


@pytest.fixture(scope="module")
def service(service_proc):
    return service_proc[1]


def run(url: str, code: str, **kw) -> dict:
    resp = httpx.post(url + "/run_code", json={"code": code, "language": "python", **kw}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_healthy(url: str) -> None:
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    out = run(url, "print(6 * 7)")
    assert out["status"] == "Success" and out["run_result"]["stdout"] == "42\n"


def test_official_sandbox_fusion_client(service):
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code

    files = {"data/in.txt": base64.b64encode(b"from a file").decode()}
    resp = run_code(RunCodeRequest(code="print(open('data/in.txt').read(), input())", language="python",
                                   stdin="and stdin\n", files=files), endpoint=service, max_attempts=1)
    assert resp.status == RunStatus.Success
    assert resp.run_result.stdout == "from a file and stdin\n" and resp.run_result.return_code == 0
    resp = run_code(RunCodeRequest(code="import sys; print('x', file=sys.stderr); sys.exit(3)", language="python"),
                    endpoint=service, max_attempts=1)
    assert resp.status == RunStatus.Failed and resp.run_result.return_code == 3 and resp.run_result.stderr == "x\n"
    resp = run_code(RunCodeRequest(code="while True: pass", language="python", run_timeout=1), endpoint=service,
                    max_attempts=1)
    assert resp.status == RunStatus.Failed and resp.run_result.status.value == "TimeLimitExceeded"


def test_bad_requests(service):
    assert run(service, "print(1)", language="cpp")["status"] == "SandboxError"
    bad = httpx.post(service + "/run_code", json={"code": "1", "language": "python", "files": {"../x": ""}})
    assert bad.status_code == 400 and "inside /tmp" in bad.text
    bad = httpx.post(service + "/run_code", json={"code": "1", "language": "python", "files": {"a": "!!"}})
    assert bad.status_code == 400
    # A timeout must be a finite, positive number of seconds (NaN used to become 0.1 s).
    for field in ("run_timeout", "compile_timeout"):
        for value in (float("nan"), float("inf"), 0, -1):
            body = json.dumps({"code": "print(1)", "language": "python", field: value})  # NaN as JSON writes it
            bad = httpx.post(service + "/run_code", content=body, headers={"content-type": "application/json"})
            assert bad.status_code == 422 and field in bad.text, (field, value, bad.text)


def test_request_size_and_time_limits():
    """stdin over --max-stdin-bytes and bodies over --max-request-bytes are 413 (the latter before the
    body is read, with or without a Content-Length); a body still incomplete --body-timeout-s after
    the headers is a 408; the service stays healthy."""
    proc, url = start_service(args=("--max-stdin-bytes", "1000", "--max-request-bytes", "100000",
                                    "--body-timeout-s", "1"))
    try:
        echo = "import sys; print(len(sys.stdin.buffer.read()))"
        assert run(url, echo, stdin="x" * 1000)["run_result"]["stdout"] == "1000\n"
        r = httpx.post(url + "/run_code", json={"code": echo, "language": "python", "stdin": "é" * 501})  # 1002 bytes
        assert r.status_code == 413 and "--max-stdin-bytes" in r.text and "1002" in r.text
        big = {"code": "#" * 150_000, "language": "python"}
        r = httpx.post(url + "/run_code", json=big)
        assert r.status_code == 413 and "--max-request-bytes" in r.text
        chunks = (json.dumps(big)[i:i + 10_000].encode() for i in range(0, 160_000, 10_000))
        r = httpx.post(url + "/run_code", content=chunks, headers={"content-type": "application/json"})  # chunked
        assert r.status_code == 413 and "--max-request-bytes" in r.text
        # A client that sends 10 of the 100 bytes it announced, then stalls.
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
            start = time.monotonic()
            sock.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"code\": \"")
            reply = b""
            while b"--body-timeout-s" not in reply and (chunk := sock.recv(4096)):  # head and body may come apart
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in reply
            assert time.monotonic() - start < 10
        assert_healthy(url)
    finally:
        stop_service(proc)


# Each attack: (code, run_timeout, check(response) -> None). They run against the live service;
# after each the service must still be healthy.
NET = """
import socket
print("ifaces", sorted(n for _, n in socket.if_nameindex()))
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3)
    print("CONNECTED")
except OSError as e:
    print("blocked", type(e).__name__)
"""
WRITE = """
import os
for p in ["/usr/evil", "/evil", "/etc/evil", "/proc/evil", "{root}/evil"]:
    try:
        open(p, "w").write("x")
        print("WROTE", p)
    except OSError as e:
        print("denied", p, type(e).__name__)
open("/tmp/ok", "w").write("fine")
print("tmp ok", open("/tmp/ok").read())
"""
READ = """
import glob, os
print("env", sorted(os.environ))
seen = []
for p in ["{root}/pytest.ini", "{root}/environments/sandbox_service.py", "/root", "/home", "/work"]:
    seen.append((p, os.path.exists(p)))
print("exists", seen)
for path in glob.glob("/proc/*/environ"):
    try:
        data = open(path, "rb").read()
        print(path, "SECRET" if b"{secret}" in data else "clean", len(data))
    except OSError as e:
        print(path, type(e).__name__)
"""
FORK_BOMB = """
import os
n = 0
while True:
    try:
        os.fork()
        n += 1
    except OSError:
        pass
"""
MEMORY_BOMB = """
blocks = []
try:
    while True:
        blocks.append(bytearray(64 << 20))
except MemoryError:
    print("MemoryError after", len(blocks) * 64, "MB")
    raise
"""
BIG_OUTPUT = """
import sys
chunk = "x" * (1 << 20)
for _ in range(100):
    sys.stdout.write(chunk)
"""
IGNORE_TERM = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()  # a child that leaves the process group and ignores SIGTERM too
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1000)
print("started", flush=True)
time.sleep(1000)
"""


def _net(r, port):
    out = r["run_result"]["stdout"]
    assert "CONNECTED" not in out and "blocked" in out and "ifaces ['lo']" in out


def _write(r, port):
    out = r["run_result"]["stdout"]
    assert "WROTE" not in out and out.count("denied") == 5 and "tmp ok fine" in out
    assert not (ROOT / "evil").exists()


def _read(r, port):
    out = r["run_result"]["stdout"]
    assert "SECRET" not in out and SECRET not in out
    assert "SANDBOX_TEST_SECRET" not in out
    assert "exists [" in out and "True" not in out.split("exists", 1)[1].splitlines()[0]


def _fork(r, port):
    assert r["status"] == "Failed" and r["run_result"]["status"] == "TimeLimitExceeded"


def _memory(r, port):
    out = r["run_result"]
    assert r["status"] == "Failed" and "MemoryError" in out["stderr"]
    used = int(out["stdout"].split("after")[1].split()[0])
    assert used <= 512  # the 512 MB address-space limit


def _loop(r, port):
    assert r["run_result"]["status"] == "TimeLimitExceeded" and r["run_result"]["execution_time"] < 5


def _output(r, port):
    out = r["run_result"]
    assert r["status"] == "Failed" and "output limit" in r["message"]
    assert len(out["stdout"]) == 1 << 20 and out["execution_time"] < 10


def _term(r, port):
    assert r["run_result"]["status"] == "TimeLimitExceeded" and r["run_result"]["stdout"] == "started\n"


ATTACKS = {
    "network": (NET, 10, _net),
    "write_outside_tmp": (WRITE, 10, _write),
    "read_project_and_secrets": (READ, 10, _read),
    "fork_bomb": (FORK_BOMB, 3, _fork),
    "memory_bomb": (MEMORY_BOMB, 10, _memory),
    "infinite_loop": (  "while True:\n    pass\n", 2, _loop),
    "output_100mb": (BIG_OUTPUT, 20, _output),
    "ignores_sigterm": (IGNORE_TERM, 2, _term),
}


def _sandbox_processes() -> list[tuple[str, str]]:
    """(state, `ps` line) of the processes of the sandbox uid (65534 when the service runs as root),
    running /tmp/main.py, or named bwrap, anywhere on the machine."""
    out = subprocess.run(["ps", "-eo", "pid,uid,stat,comm,args"], capture_output=True,
                         text=True).stdout.splitlines()[1:]
    return [(line.split()[2], line) for line in out
            if "/tmp/main.py" in line or line.split()[1] == "65534" or line.split()[3] == "bwrap"]


def _zombie_children(pid: int) -> list[str]:
    sys.path.insert(0, str(ROOT / "environments"))
    from sandbox_exec import _children, _status

    return [f"{c} {_status(c).get('Name')}" for c in _children(pid) if _status(c).get("State", "").startswith("Z")]


def assert_nothing_left(service_pid: int, within_s: float = 1.0) -> None:
    """Nothing a finished request started still runs anywhere (checked at once: the call returns only
    after the sandbox is gone), and the service has reaped its exited children within `within_s` (a
    zombie, state Z, holds no resources but its pid; one per request that lingers is a leak). Zombies
    are looked for among the service's children only: a container whose init never reaps keeps the
    zombies of other tests' processes for good."""
    running = [line for state, line in _sandbox_processes() if not state.startswith("Z")]
    assert not running, f"sandbox processes still running after their request returned: {running}"
    deadline = time.monotonic() + within_s
    while _zombie_children(service_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    zombies = _zombie_children(service_pid)
    assert not zombies, f"sandbox processes not reaped {within_s:g} s after their request returned: {zombies}"


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_contained(service_proc, name):
    proc, service = service_proc
    code, timeout, check = ATTACKS[name]
    port = int(service.rsplit(":", 1)[1])
    code = code.format(port=port, root=ROOT, secret=SECRET)
    start = time.monotonic()
    r = run(service, code, run_timeout=timeout)
    elapsed = time.monotonic() - start
    check(r, port)
    assert elapsed < timeout + 15
    # Nothing the program started survives it (the pid namespace dies with its pid 1), nor lingers unreaped.
    assert_nothing_left(proc.pid)
    assert_healthy(service)
    print(f"\nSECURITY {name}: status={r['status']} run={r['run_result']['status']} "
          f"rc={r['run_result']['return_code']} message={r['message']!r} in {elapsed:.2f}s")


def test_a_timed_out_request_leaves_no_process_and_no_zombie(service_proc):
    """A killed sandbox is reaped by the time its request returns: the service kills the sandbox's
    pid 1 (bwrap reaps it and exits) rather than bwrap itself (whose orphan init reaps when it can)."""
    proc, service = service_proc
    for _ in range(3):
        r = run(service, "import os\nos.fork()\nwhile True:\n    pass\n", run_timeout=1)
        assert r["run_result"]["status"] == "TimeLimitExceeded"
        assert_nothing_left(proc.pid)


IN_PROCESS_SCRIPT = """
import asyncio, ctypes, os, sys
sys.path.insert(0, "environments")
from sandbox_exec import SandboxExecutor, _children, _status

# Stand in for an init that never reaps (a container whose pid 1 is the trainer): become the child
# subreaper and reap nothing, so any sandbox process orphaned by an in-process run shows as our zombie.
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0

async def main():
    ex = SandboxExecutor(max_concurrency=2)  # in-process: no reaper of its own
    results = await asyncio.gather(*(ex.run(code, run_timeout=1) for code in
                                     ["print(1)"] * 6 + ["import os; os.fork(); print(2)", "while True: pass"]))
    print(" ".join(r.status for r in results))
    await asyncio.sleep(0.5)
    print("zombies", [p for p in _children(os.getpid()) if _status(p).get("State", "").startswith("Z")])

asyncio.run(main())
"""


def test_an_in_process_run_orphans_nothing():
    """In-process (an env module without SANDBOX_URL) nothing is left for the host's init to reap:
    bwrap waits for the sandbox's pid 1 itself. With bwrap's own init as pid 1, bwrap exited first and
    every run left one zombie behind, for good under a container init that never reaps."""
    out = subprocess.run([sys.executable, "-c", IN_PROCESS_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    statuses, zombies = out.stdout.splitlines()
    assert statuses.split() == ["Finished"] * 7 + ["TimeLimitExceeded"]
    assert zombies == "zombies []", out.stdout


ORPHAN_SCRIPT = """
import asyncio, os, signal, sys, time
sys.path.insert(0, "environments")
from sandbox_exec import SandboxExecutor, _children

async def main():
    ex = SandboxExecutor(max_concurrency=1, reap_orphans=True)
    run = asyncio.ensure_future(ex.run("import time; time.sleep(60)", run_timeout=30))
    while not any(_children(c) for c in _children(os.getpid())):  # bwrap and its sandbox are up
        await asyncio.sleep(0.05)
    bwrap = next(c for c in _children(os.getpid()) if _children(c))
    os.kill(bwrap, signal.SIGKILL)  # bwrap dies before its sandbox: the sandbox is orphaned
    await run
    deadline = time.monotonic() + 1.0
    while _children(os.getpid()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    print("left", _children(os.getpid()))

asyncio.run(main())
"""


def test_a_service_reaps_a_sandbox_orphaned_by_its_bwrap():
    """bwrap killed from outside before its sandbox (say by the OOM killer): the sandbox's pid 1 is
    re-parented to the service (its child subreaper), killed if it still runs (a bwrap killed during
    set-up leaves it running: its request's wall-clock timeout went with the bwrap) and reaped within
    a second, not left to init."""
    out = subprocess.run([sys.executable, "-c", ORPHAN_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["left", "[]"], out.stdout


def test_load(service):
    """4x max-concurrency x 4 requests at once: all answered correctly; prints requests/s."""
    n = MAX_CONCURRENCY * 16

    async def main() -> float:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> None:
                r = await client.post(service + "/run_code", json={
                    "code": "import sys\nn = int(input())\nprint(sum(range(n)))", "language": "python",
                    "stdin": f"{i}\n"})
                assert r.status_code == 200 and r.json()["run_result"]["stdout"] == f"{sum(range(i))}\n"

            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            return time.perf_counter() - start

    elapsed = asyncio.run(main())
    print(f"\nLOAD {n} concurrent requests, max concurrency {MAX_CONCURRENCY}: {elapsed:.2f} s, "
          f"{n / elapsed:.1f} requests/s")
    assert_healthy(service)


def test_queue_full_is_503():
    proc, url = start_service(max_concurrency=1, args=("--max-queue", "1"))
    try:
        async def main() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                reqs = [client.post(url + "/run_code", json={"code": "import time; time.sleep(1)",
                                                             "language": "python"}) for _ in range(4)]
                return [r.status_code for r in await asyncio.gather(*reqs)]

        codes = asyncio.run(main())
        assert codes.count(200) >= 2 and 503 in codes
    finally:
        stop_service(proc)


def test_refuses_to_start_without_bwrap():
    proc = subprocess.run([sys.executable, "environments/sandbox_service.py", "--port", str(free_port())],
                          cwd=ROOT, env={**os.environ, "SANDBOX_BWRAP": "/nonexistent/bwrap"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "refusing to start" in proc.stderr and "bwrap" in proc.stderr and "install" in proc.stderr


def test_executor_in_process_limits_and_files():
    sys.path.insert(0, str(ROOT / "environments"))
    from sandbox_exec import Limits, SandboxExecutor, SandboxRequestError, SandboxRequestTooLarge

    async def main() -> None:
        ex = SandboxExecutor(Limits(max_output_bytes=1000), max_concurrency=2)
        r = await ex.run("import os; print(sorted(os.listdir('.')), open('a/b.txt').read())",
                         files={"a/b.txt": b"deep"})
        assert r.status == "Finished" and r.stdout == "['a', 'main.py'] deep\n"
        r = await ex.run("print('y' * 5000)")
        assert r.reason == "output_limit" and len(r.stdout) == 1000
        with pytest.raises(SandboxRequestError):
            await ex.run("1", files={"/etc/passwd": b""})
        with pytest.raises(SandboxRequestTooLarge, match="max-stdin-bytes"):
            await ex.run("1", stdin="x" * ((8 << 20) + 1))
        for timeout in (float("nan"), float("inf"), 0.0, -1.0):
            with pytest.raises(SandboxRequestError, match="run_timeout"):
                await ex.run("1", run_timeout=timeout)
        # Bounded concurrency: 6 sleeps of 0.5 s with 2 slots take >= 1.5 s.
        start = time.perf_counter()
        await asyncio.gather(*(ex.run("import time; time.sleep(0.5)") for _ in range(6)))
        assert time.perf_counter() - start >= 1.4

    asyncio.run(main())
