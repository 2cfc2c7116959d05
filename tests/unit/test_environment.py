"""Env modules: loading errors, isolation of failures, timeouts, not blocking the event loop."""
import asyncio
import os
import textwrap
import time

import pytest

from conftest import ROOT
from train.workers.environment import EnvCallError, EnvLoadError, Environment


def write_env(tmp_path, body: str, name: str = "env.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def make(path, timeout=2.0, max_turns=1):
    return Environment(path, timeout_s=timeout, max_workers=4, max_turns=max_turns)


def test_missing_reward_fn_is_a_clear_error(tmp_path):
    path = write_env(tmp_path, "def interact(messages):\n    return []\n")
    with pytest.raises(EnvLoadError, match=r"rollout.env_path: .*env.py' defines no reward_fn"):
        make(path)


def test_missing_interact_only_matters_for_multi_turn(tmp_path):
    path = write_env(tmp_path, "def reward_fn(messages, answer):\n    return 1.0\n")
    make(path, max_turns=1)
    with pytest.raises(EnvLoadError, match="defines no interact.*max_turns=3"):
        make(path, max_turns=3)


def test_missing_file_and_import_error(tmp_path):
    with pytest.raises(EnvLoadError, match="no such file"):
        make(str(tmp_path / "nope.py"))
    path = write_env(tmp_path, "import not_a_real_module_xyz\n")
    with pytest.raises(EnvLoadError, match="importing .* failed: ModuleNotFoundError"):
        make(path)


def test_raising_and_hanging_calls_become_env_errors(tmp_path):
    path = write_env(tmp_path, """
        import time
        def reward_fn(messages, answer):
            if answer == "raise":
                raise RuntimeError("boom")
            if answer == "hang":
                time.sleep(30)
            if answer == "nan":
                return float("nan")
            return 0.5
    """)
    env = make(path, timeout=0.5)

    async def go():
        return await asyncio.gather(*(env.reward([], a) for a in ("raise", "hang", "nan", "ok")),
                                    return_exceptions=True)

    start = time.perf_counter()
    raised, hung, nan, ok = asyncio.run(go())
    assert time.perf_counter() - start < 5
    assert isinstance(raised, EnvCallError) and raised.kind == "exception" and "boom" in str(raised)
    assert isinstance(hung, EnvCallError) and hung.kind == "timeout"
    assert isinstance(nan, EnvCallError) and "NaN" in str(nan)
    assert ok == 0.5
    env.close()


def test_sync_env_code_runs_off_the_event_loop(tmp_path):
    """Four 0.4 s blocking reward calls overlap (thread pool) instead of taking 1.6 s."""
    path = write_env(tmp_path, """
        import time
        def reward_fn(messages, answer):
            time.sleep(0.4)
            return 1.0
    """)
    env = make(path)

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        out = await asyncio.gather(*(env.reward([], None) for _ in range(4)))
        t.cancel()
        return out, ticks

    start = time.perf_counter()
    out, ticks = asyncio.run(go())
    assert out == [1.0] * 4
    assert time.perf_counter() - start < 1.2
    assert ticks > 10  # the loop kept running while env code blocked


def test_async_env_functions_and_message_isolation(tmp_path):
    path = write_env(tmp_path, """
        async def interact(messages):
            messages.append({"role": "user", "content": "mutated"})
            return [{"role": "tool", "content": "ok"}]
        async def reward_fn(messages, answer):
            return len(messages)
    """)
    env = make(path, max_turns=2)
    conv = [{"role": "user", "content": "hi"}]
    assert asyncio.run(env.interact(conv)) == [{"role": "tool", "content": "ok"}]
    assert conv == [{"role": "user", "content": "hi"}]  # env got a copy
    assert asyncio.run(env.reward(conv, None)) == 1.0


def test_bad_interact_return_type(tmp_path):
    path = write_env(tmp_path, """
        def interact(messages):
            return "not a list"
        def reward_fn(messages, answer):
            return 0.0
    """)
    env = make(path, max_turns=2)
    with pytest.raises(EnvCallError, match="expected a list of message dicts"):
        asyncio.run(env.interact([]))


def test_shipped_envs():
    import importlib.util

    for name, answer, good, bad in [("eq", "68", "<answer> 68 </answer>", "<answer>67</answer>"),
                                    ("orz", "1/2", "<answer>0.5</answer>", "<answer>2</answer>")]:
        spec = importlib.util.spec_from_file_location(name, ROOT / "environments" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": good}]
        assert mod.reward_fn(conv, answer) == 1.0
        conv[-1]["content"] = bad
        assert mod.reward_fn(conv, answer) == 0.0
        assert mod.interact(conv) == []


def test_a_call_that_never_returns_does_not_block_exit(tmp_path):
    import subprocess
    import sys

    path = write_env(tmp_path, "import time\ndef reward_fn(messages, answer):\n    time.sleep(10_000)\n")
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(ROOT)!r})
        from train.workers.environment import Environment, EnvCallError
        env = Environment({path!r}, timeout_s=0.3, max_workers=2, max_turns=1)
        try:
            asyncio.run(env.reward([], None))
        except EnvCallError as e:
            print("scored:", e.kind)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0 and "scored: timeout" in proc.stdout


def test_env_file_with_dataclasses_and_future_annotations(tmp_path):
    path = write_env(tmp_path, """
        from __future__ import annotations
        from dataclasses import dataclass

        @dataclass
        class Score:
            value: float

        def reward_fn(messages, answer):
            return Score(0.25).value
    """, name="dc_env.py")
    assert asyncio.run(make(path).reward([], None)) == 0.25


def test_env_isolation_is_complete(tmp_path):
    """sys.exit() / KeyboardInterrupt inside env code (sync and async), malformed messages from
    interact and non-finite rewards each score only their sample, with the env file and function
    named; well-formed messages (string content, content parts, tool calls) pass."""
    path = write_env(tmp_path, """
        import sys
        def interact(messages):
            kind = messages[-1]["content"]
            return {"no_content": [{"role": "tool"}], "int": [{"role": "tool", "content": 42}],
                    "role": [{"role": "robot", "content": "x"}],
                    "ok": [{"role": "tool", "content": "x"},
                           {"role": "user", "content": [{"type": "text", "text": "y"}]},
                           {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
                    "exit": None}[kind] if kind != "exit" else sys.exit(3)
        async def reward_fn(messages, answer):
            if answer == "exit":
                sys.exit(2)
            if answer == "interrupt":
                raise KeyboardInterrupt
            return {"inf": float("inf"), "-inf": float("-inf")}.get(answer, 1.0)
    """)
    env = make(path, max_turns=2)
    name = os.path.basename(path)

    async def go():
        rewards = [env.reward([], a) for a in ("exit", "interrupt", "inf", "-inf", "ok")]
        turns = [env.interact([{"role": "assistant", "content": k}])
                 for k in ("no_content", "int", "role", "exit", "ok")]
        return await asyncio.gather(*rewards, *turns, return_exceptions=True)

    r_exit, r_int, r_inf, r_minf, r_ok, i_none, i_int, i_role, i_exit, i_ok = asyncio.run(go())
    for err, words in ((r_exit, "SystemExit(2)"), (r_int, "KeyboardInterrupt"), (r_inf, "returned inf"),
                       (r_minf, "returned -inf"), (i_none, "message 0: content must be a string"),
                       (i_int, "got int"), (i_role, "role must be one of"), (i_exit, "SystemExit: 3")):
        assert isinstance(err, EnvCallError) and words in str(err), (err, words)
        assert str(err).startswith(f"{name}:"), err
    assert r_ok == 1.0 and len(i_ok) == 3
    env.close()


def test_hung_sync_calls_do_not_grow_threads_without_bound(tmp_path):
    """A reward_fn that never returns used to leak one thread per timed-out call (35 -> 396 threads
    per rank in 6 steps). Now at most max_workers stuck threads are replaced; calls queued behind
    them time out without ever running; a stuck call that returns gives its thread back."""
    import threading

    path = write_env(tmp_path, """
        import threading
        release = threading.Event()
        def reward_fn(messages, answer):
            if answer == "hang":
                release.wait()
            return 1.0
    """)
    env = make(path, timeout=0.2)  # 4 workers

    def threads() -> int:
        return sum(t.name == env._pool.thread_name for t in threading.enumerate())

    async def rounds():
        for _ in range(5):
            await asyncio.gather(*(env.reward([], "hang") for _ in range(8)), return_exceptions=True)

    asyncio.run(rounds())
    # The 4 workers got stuck and were replaced once; their replacements got stuck and were not:
    # 40 timed-out calls hold 8 threads, not 40.
    assert env.stuck_calls == 8
    assert threads() == 4 + 4
    env.module.release.set()  # the stuck calls return: their threads leave, capacity comes back
    deadline = time.time() + 5
    while env.stuck_calls and time.time() < deadline:
        time.sleep(0.05)
    assert env.stuck_calls == 0
    assert asyncio.run(env.reward([], "ok")) == 1.0
    time.sleep(0.2)
    assert threads() == 4
    env.close()
