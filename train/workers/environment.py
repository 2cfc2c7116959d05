"""Environment modules: `interact(messages) -> list[dict]` and `reward_fn(messages, answer) -> float`,
loaded from a file path. Env code is isolated from the run: sync functions run in daemon threads
(the event loop keeps generating), every call has a timeout, and a failure becomes an
`EnvCallError` that the rollout turns into `rollout.env_error_reward` for that sample only."""
from __future__ import annotations

import asyncio
import copy
import importlib.util
import inspect
import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from train.workers.rubric import RubricScore


class EnvLoadError(ValueError):
    pass


ROLES = ("system", "user", "assistant", "tool")


class EnvCallError(RuntimeError):
    """An env call raised or timed out; `kind` is 'exception' or 'timeout'. The message names the
    env file and function (`env.py:reward_fn: exception: ...`)."""

    def __init__(self, fn: str, kind: str, detail: str, env: str = ""):
        super().__init__(f"{env + ':' if env else ''}{fn}: {kind}: {detail}")
        self.fn, self.kind, self.detail, self.env = fn, kind, detail, env


def message_problem(message: Any) -> str | None:
    """Why `message` cannot go into a chat template, or None: a dict with a known role and content
    that is a string or a list of content parts (dicts with a "type")."""
    if not isinstance(message, dict):
        return f"a message must be a dict, got {type(message).__name__}"
    if message.get("role") not in ROLES:
        return f"role must be one of {', '.join(ROLES)}, got {message.get('role')!r:.50}"
    content = message.get("content")
    if isinstance(content, str):
        return None
    if isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content):
        return None
    if content is None and message.get("tool_calls"):  # an assistant message that only calls tools
        return None
    return f"content must be a string or a list of content parts, got {type(content).__name__}"


def load_env_module(path: str, key: str = "rollout.env_path") -> ModuleType:
    """Import an env file by path (once per process: the caller keeps the module); errors name `key`."""
    if not os.path.isfile(path):
        raise EnvLoadError(f"{key}: no such file '{path}'")
    name = "infinite_rl_env_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # Env files may import siblings (e.g. a service client next to them).
    env_dir = os.path.dirname(os.path.abspath(path))
    if env_dir not in sys.path:
        sys.path.insert(0, env_dir)
    # Registered before running, as a normal import would be (dataclasses and pickling look it up).
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - report any import-time failure with the file name
        sys.modules.pop(name, None)
        raise EnvLoadError(f"{key}: importing '{path}' failed: {type(e).__name__}: {e}") from e
    return module


class Environment:
    def __init__(self, path: str, *, timeout_s: float, max_workers: int, max_turns: int,
                 key: str = "rollout.env_path"):
        self.path = path
        self.module = load_env_module(path, key)
        self.reward_fn = getattr(self.module, "reward_fn", None)
        self.interact_fn = getattr(self.module, "interact", None)
        if not callable(self.reward_fn):
            raise EnvLoadError(
                f"{key}: '{path}' defines no reward_fn(messages, answer) -> float; "
                "every env module needs one (it may be async)")
        if max_turns > 1 and not callable(self.interact_fn):
            raise EnvLoadError(
                f"{key}: '{path}' defines no interact(messages) -> list[dict], which "
                f"rollout.max_turns={max_turns} needs; define it (return [] to end the episode) "
                "or set rollout.max_turns=1")
        self.timeout_s = timeout_s
        self.name = os.path.basename(path)
        self._pool = DaemonThreadPool(max_workers)
        self._in_flight: dict[int, tuple[str, float]] = {}  # call id -> (function, start): for the watchdog

    @property
    def stuck_calls(self) -> int:
        """Sync env calls still running past their timeout (each holds a thread)."""
        return self._pool.stuck

    def longest_call(self) -> str:
        """The env call in flight the longest, e.g. `env.py:reward_fn for 42 s` ('' when none)."""
        calls = list(self._in_flight.values())
        if not calls:
            return ""
        fn, start = min(calls, key=lambda c: c[1])
        return f"env call in flight the longest: {self.name}:{fn} for {time.monotonic() - start:.0f} s"

    async def _call(self, name: str, fn, *args) -> Any:
        args = copy.deepcopy(args)  # env code must not mutate the rollout's conversation
        key = id(args)
        self._in_flight[key] = (name, time.monotonic())
        try:
            return await self._run(name, fn, args)
        finally:
            self._in_flight.pop(key, None)

    async def _run(self, name: str, fn, args: tuple) -> Any:
        try:
            if inspect.iscoroutinefunction(fn):
                return await asyncio.wait_for(_contained(fn(*args)), self.timeout_s)
            call = self._pool.submit(asyncio.get_running_loop(), fn, args)
            try:
                return await asyncio.wait_for(call.future, self.timeout_s)
            except asyncio.TimeoutError:
                self._pool.abandon(call)  # a hung call keeps its thread; the pool replaces it (bounded)
                raise
        except asyncio.TimeoutError:
            raise self.error(name, "timeout", f"no answer within rollout.env_timeout_s={self.timeout_s}") from None
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - any env failure, sys.exit() included, scores only this sample
            raise self.error(name, "exception", f"{type(e).__name__}: {e}") from e

    def error(self, fn: str, kind: str, detail: str) -> EnvCallError:
        return EnvCallError(fn, kind, detail, env=self.name)

    async def interact(self, messages: list[dict]) -> list[dict]:
        out = await self._call("interact", self.interact_fn, messages)
        if out is None:
            return []
        if not isinstance(out, list):
            raise self.error("interact", "exception", f"expected a list of message dicts, got {out!r:.200}")
        for i, message in enumerate(out):
            problem = message_problem(message)
            if problem:
                raise self.error("interact", "exception", f"message {i}: {problem}")
        return out

    async def reward(self, messages: list[dict], answer: Any) -> float:
        """The reward; a rubric's (train/workers/rubric.py) comes back as a RubricScore, its criteria with it."""
        value = await self._call("reward_fn", self.reward_fn, messages, answer)
        criteria, errors = getattr(value, "criteria", None), getattr(value, "errors", None)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise self.error("reward_fn", "exception", f"expected a float, got {value!r:.200}") from None
        if not math.isfinite(value):  # NaN or inf would poison the advantages of the whole group
            raise self.error("reward_fn", "exception",
                             f"returned {'NaN' if value != value else value} (rewards must be finite)")
        return RubricScore(value, criteria, errors) if isinstance(criteria, dict) else value

    def pop_api_calls(self) -> list[dict]:
        """Records of external calls made since the last pop, if the module keeps them
        (see train.utils.api_stats); env modules that call nothing return []."""
        pop = getattr(self.module, "pop_api_calls", None)
        return list(pop()) if callable(pop) else []

    def close(self) -> None:
        self._pool.shutdown()


class EnvExit(Exception):
    """SystemExit / KeyboardInterrupt raised by env code, carried as an ordinary exception: asyncio
    re-raises those two out of the event loop from any task, which would end the whole run."""


async def _contained(coro) -> Any:
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as e:
        raise EnvExit(f"{type(e).__name__}({e})") from None


@dataclass
class _Call:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    fn: Any
    args: tuple
    running: bool = False
    abandoned: bool = False  # its caller timed out: never start it; if running, its thread is stuck


class DaemonThreadPool:
    """Daemon worker threads for sync env functions. Unlike ThreadPoolExecutor, whose workers are
    joined at interpreter exit, a call that hangs forever cannot keep the trainer from exiting.

    A call whose caller timed out is `abandon`ed: if it had not started it never runs; if it is
    running, its thread is stuck (Python cannot stop it) and a new worker replaces the capacity, up
    to `max_stuck` stuck threads at once. Past that, capacity shrinks instead of threads growing
    without bound (calls then wait and time out, scoring their samples as env errors), and `stuck`
    says so. A stuck call that returns frees its thread, which exits if the pool is at capacity."""

    def __init__(self, n_workers: int, max_stuck: int | None = None):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.target, self.max_stuck = n_workers, n_workers if max_stuck is None else max_stuck
        self.threads = self.stuck = 0
        self.thread_name = f"env-call-{id(self):x}"  # this pool's threads, for tests and stack dumps
        for _ in range(n_workers):
            self._start_worker()

    def _start_worker(self) -> None:
        self.threads += 1
        threading.Thread(target=self._work, name=self.thread_name, daemon=True).start()

    def submit(self, loop: asyncio.AbstractEventLoop, fn, args) -> _Call:
        call = _Call(loop, loop.create_future(), fn, args)
        self._queue.put(call)
        return call

    def abandon(self, call: _Call) -> None:
        """The caller stopped waiting for `call` (a timeout)."""
        with self._lock:
            call.abandoned = True
            if call.running:
                self.stuck += 1
                if self.stuck <= self.max_stuck:
                    self._start_worker()

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            with self._lock:
                if call.abandoned:
                    continue  # timed out while queued: nobody waits for it
                call.running = True
            try:
                outcome = (True, call.fn(*call.args))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                outcome = (False, e)
            with self._lock:
                call.running = False
                if call.abandoned:  # a stuck call came back
                    self.stuck -= 1
                    if self.threads - self.stuck > self.target:
                        self.threads -= 1
                        return  # its replacement already serves the queue
                    continue
            try:
                call.loop.call_soon_threadsafe(_deliver, call.future, outcome)
            except RuntimeError:  # the loop closed while this call ran: nobody is waiting
                pass

    def shutdown(self) -> None:
        for _ in range(self.threads):
            self._queue.put(None)


def _deliver(future: asyncio.Future, outcome: tuple[bool, object]) -> None:
    if future.done():  # cancelled by a timeout
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
