"""environments/code.py: code extraction, test checking in the sandbox (in-process and through the
service), the prompt builder, and a real code-RL trainer run against the running service."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from conftest import ROOT, read_jsonl, run_trainer
from test_sandbox import start_service, stop_service
from train.workers.environment import load_env_module

CODE_DATA = ROOT / "stub" / "data" / "code"


@pytest.fixture(scope="module")
def code_env():
    return load_env_module(str(ROOT / "environments" / "code.py"))


def rows() -> list[dict]:
    return read_jsonl(CODE_DATA / "train.jsonl") + read_jsonl(CODE_DATA / "test.jsonl")


def reply(code: str, prose: str = "Here is my solution:") -> dict:
    return {"role": "assistant", "content": f"{prose}\n```python\n{code}```\n"}


def test_extract_code_takes_the_last_block(code_env):
    text = "first\n```python\nprint(1)\n```\nthen\n```\nprint(2)\n```\nbye"
    assert code_env.extract_code(text) == "print(2)\n"
    assert code_env.extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert code_env.extract_code("no code here") is None
    assert code_env.extract_code("```python\nunclosed") is None


def test_outputs_match(code_env):
    assert code_env.outputs_match("1 2\n3  \n", "1 2\n3\n")
    assert code_env.outputs_match("0.3333333\n", "0.33333333\n")
    assert not code_env.outputs_match("1\n2\n", "1\n")
    assert not code_env.outputs_match("abc\n", "abd\n")


def test_no_code_block_is_a_format_penalty_without_sandbox_call(code_env, monkeypatch):
    async def boom(*a, **k):
        raise AssertionError("the sandbox must not be called")

    monkeypatch.setattr(code_env.CLIENT, "run", boom)
    row = rows()[0]
    assert asyncio.run(code_env.reward_fn(row["messages"] + [{"role": "assistant", "content": "42"}],
                                          row["answer"])) == pytest.approx(-0.1)


def test_reference_solutions_pass_and_wrong_ones_fail(code_env):
    data = rows()
    assert {t["testtype"] for r in data for t in r["answer"]["tests"]} == {"stdin", "functional"}

    async def main():
        good = [code_env.reward_fn(r["messages"] + [reply(r["answer"]["reference_solution"])], r["answer"])
                for r in data]
        bad = [code_env.reward_fn(r["messages"] + [reply("print('nope')\n")], r["answer"]) for r in data[:4]]
        return await asyncio.gather(*good), await asyncio.gather(*bad)

    good, bad = asyncio.run(main())
    assert good == [1.0] * len(data)
    assert bad == [0.0] * 4
    calls = code_env.pop_api_calls()
    assert calls and all(c["type"] == "sandbox" for c in calls)


def test_functional_tests_with_solution_class_and_json_string_answer(code_env):
    answer = {"tests": [{"input": "[1, 2, 3]\n2", "output": "[2, 4, 6]", "testtype": "functional"}],
              "fn_name": "scale", "starter_code": "class Solution:\n    def scale(self, xs, k):"}
    code = ("class Solution:\n    def scale(self, xs, k):\n        print('noise')\n        return [x * k for x in xs]\n"
            "if __name__ == '__main__':\n    input()  # must not run when imported\n")
    msgs = [{"role": "user", "content": "scale"}, reply(code)]
    assert asyncio.run(code_env.reward_fn(msgs, json.dumps(answer))) == 1.0
    wrong = [{"role": "user", "content": "scale"}, reply("class Solution:\n    def scale(self, xs, k):\n        return xs\n")]
    assert asyncio.run(code_env.reward_fn(wrong, answer)) == 0.0


def test_per_test_timeout_fails_fast(code_env):
    answer = {"tests": [{"input": "1", "output": "1\n", "testtype": "stdin"}] * 3, "fn_name": None}

    async def main():
        return await code_env.check("while True:\n    pass\n", answer, timeout=1)

    import time

    start = time.monotonic()
    assert asyncio.run(main()) is False
    assert time.monotonic() - start < 5  # stops at the first failing test


def test_clients_are_per_event_loop(code_env):
    """Two threads with their own loops share the module's client without sharing pools."""
    row = rows()[0]
    msgs = row["messages"] + [reply(row["answer"]["reference_solution"])]
    results: list[float] = []

    def worker() -> None:
        results.append(asyncio.run(code_env.reward_fn(msgs, row["answer"])))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1.0, 1.0]


def test_prompt_builder_like_livecodebench(code_env):
    msgs = code_env.build_messages("Add two numbers.", "def add(a, b):")
    assert msgs[0]["role"] == "system" and "expert Python programmer" in msgs[0]["content"]
    user = msgs[1]["content"]
    assert "### Question:\nAdd two numbers." in user and "```python\ndef add(a, b):\n```" in user
    assert "### Answer:" in user
    assert "standard input" in code_env.build_messages("Echo.")[1]["content"]
    row = code_env.row_from_livecodebench({
        "question_content": "Return a+b.", "starter_code": "class Solution:\n    def add(self, a, b):",
        "public_test_cases": json.dumps([{"input": "1\n2", "output": "3", "testtype": "functional"}]),
        "private_test_cases": "eJzLSM3JyQcABiwCFQ==", "metadata": json.dumps({"func_name": "add"})})
    assert row["answer"]["fn_name"] == "add" and len(row["answer"]["tests"]) == 1
    good = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
    assert asyncio.run(code_env.reward_fn(row["messages"] + [reply(good)], row["answer"])) == 1.0


@pytest.fixture(scope="module")
def service_url():
    proc, url = start_service(max_concurrency=2)
    yield url
    stop_service(proc)


def test_through_the_service(service_url, monkeypatch):
    monkeypatch.setenv("SANDBOX_URL", service_url)
    env = load_env_module(str(ROOT / "environments" / "code.py"))
    assert env.CLIENT.url == service_url
    data = rows()[:6]

    async def main():
        return await asyncio.gather(*(env.reward_fn(r["messages"] + [reply(r["answer"]["reference_solution"])],
                                                    r["answer"]) for r in data))

    assert asyncio.run(main()) == [1.0] * 6
    assert len(env.pop_api_calls()) >= 6 * 3


def test_code_rl_run_against_the_service(service_url, tmp_path, monkeypatch):
    """The stub model cannot write code (every reply scores -0.1), but the run is real end to end:
    two ranks, the code env, the service from its documented command."""
    monkeypatch.setenv("SANDBOX_URL", service_url)
    save = tmp_path / "run"
    run_trainer([f"trainer.save_dir={save}", "trainer.total_steps=2", "trainer.test_freq=null",
                 "data.prompts_per_rollout=4", "data.responses_per_prompt=2",
                 "rollout.train_sampling_params.max_new_tokens=16"], nproc=2, config="code", timeout=300)
    metrics = read_jsonl(save / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["env/errors"] == 0 for m in metrics)
    assert all(-0.1 - 1e-6 <= m["rewards/train"] <= 1.0 for m in metrics)
    assert (save / "latest" / "model.safetensors").exists()
