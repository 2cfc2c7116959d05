"""Code RL: reward 1.0 when the program in the final reply passes every test of the row.

The row's `answer` holds LiveCodeBench-style tests (see stub/data/README.md):
`{"tests": [{"input", "output", "testtype": "stdin" | "functional"}], "fn_name", "starter_code"}`.

* The code is the last fenced block (```` ```python ... ``` ````, any or no language tag) of the final
  assistant message. No block: reward `-CODE_FORMAT_COEF` (default 0.1), no sandbox call.
* `stdin` tests run the program with the input on standard input; its output must match the
  expected one line by line (trailing whitespace ignored, numbers compared with a 1e-6 tolerance).
* `functional` tests import the program as a module (its `__main__` block does not run), call
  `fn_name` (a top-level function, or a method of `class Solution` as LeetCode starter code
  declares) with one JSON value per input line, and compare the JSON of the result.
* Tests run one after another in the sandbox (`CODE_TEST_TIMEOUT_S`, default 6 s, each) and stop at
  the first failure; the whole check has `(timeout + 1) * n_tests + 5` s, past which it fails.

Where programs run: the sandbox service at `SANDBOX_URL` (`python environments/sandbox_service.py`)
or, with no URL set, the same bubblewrap executor in this process. At most
`SANDBOX_MAX_CONCURRENCY` (default 8) calls per event loop are in flight. Set
`rollout.env_timeout_s` above the total timeout (config/code.yaml does).

`build_messages` / `row_from_livecodebench` turn a problem into a prompt the way LiveCodeBench's
code-generation prompts are laid out: system prompt, the problem, the starter code (or the stdin/
stdout instructions), and the request for one fenced code block.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import re
import secrets
import sys
from typing import Any

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # loaded by path: find the client
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sandbox_client import SandboxClient  # noqa: E402

from train.utils.api_stats import ApiCallRecorder  # noqa: E402

FORMAT_COEF = float(os.environ.get("CODE_FORMAT_COEF", "0.1"))
TEST_TIMEOUT_S = float(os.environ.get("CODE_TEST_TIMEOUT_S", "6"))

SYSTEM_PROMPT = ("You are an expert Python programmer. You will get a programming problem; write a correct "
                 "Python 3 program that meets its specification and passes all of its tests.")
STDIN_FORMAT = ("Read the input from standard input, solve the problem and write the answer to standard "
                "output (do not test on the sample inputs). Put your complete program in one fenced code block:\n"
                "```python\n# YOUR CODE HERE\n```")
STARTER_FORMAT = "Complete the starter code below and put your whole solution in one fenced code block:\n"

FENCE = re.compile(r"```[ \t]*[\w+#.-]*[ \t]*\n(.*?)```", re.DOTALL)

# One recorder and one sandbox client per process (the module is loaded once per process); the
# client keeps a separate HTTP pool per event loop.
RECORDER = ApiCallRecorder()
CLIENT = SandboxClient(recorder=RECORDER)
pop_api_calls = RECORDER.pop


# ----------------------------------------------------------------------------------------- prompts

def build_messages(question: str, starter_code: str = "", system_prompt: str | None = SYSTEM_PROMPT) -> list[dict]:
    """Prompt messages for one problem (system prompt, problem, format instructions)."""
    parts = [f"### Question:\n{question.strip()}\n"]
    if starter_code.strip():
        parts.append(f"### Format: {STARTER_FORMAT}```python\n{starter_code.rstrip()}\n```\n")
    else:
        parts.append(f"### Format: {STDIN_FORMAT}\n")
    parts.append("### Answer: (use the format above, with the backticks)\n")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": "\n".join(parts)}]


def row_from_livecodebench(example: dict, system_prompt: str | None = SYSTEM_PROMPT) -> dict:
    """A data row from a LiveCodeBench `code_generation` record (`question_content`, `starter_code`,
    `public_test_cases` / `private_test_cases` as JSON text, `metadata` with `func_name`).
    Private tests stored compressed (zlib + pickle) are not decoded: unpickling is unsafe."""
    tests = []
    for key in ("public_test_cases", "private_test_cases"):
        raw = example.get(key) or "[]"
        try:
            tests += json.loads(raw) if isinstance(raw, str) else list(raw)
        except json.JSONDecodeError:
            continue
    meta = example.get("metadata") or {}
    meta = json.loads(meta) if isinstance(meta, str) else meta
    starter = example.get("starter_code") or ""
    answer = {"tests": [{"input": t["input"], "output": t["output"], "testtype": t.get("testtype", "stdin")}
                        for t in tests],
              "fn_name": meta.get("func_name"), "starter_code": starter,
              "name": example.get("question_id") or example.get("question_title") or ""}
    return {"messages": build_messages(example.get("question_content", ""), starter, system_prompt), "answer": answer}


# ------------------------------------------------------------------------------------------ checks

def extract_code(text: str) -> str | None:
    """The last fenced code block of `text`, or None."""
    blocks = FENCE.findall(text or "")
    return blocks[-1] if blocks else None


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _tokens_match(got: str, want: str) -> bool:
    if got == want:
        return True
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


def outputs_match(got: str, want: str) -> bool:
    """stdout equality, LiveCodeBench-style: line by line, trailing whitespace ignored, numbers
    compared with a small tolerance."""
    a, b = _lines(got), _lines(want)
    return len(a) == len(b) and all(_tokens_match(x, y) for x, y in zip(a, b))


_HARNESS = """\
import importlib.util, json, sys
_spec = importlib.util.spec_from_file_location("solution", "solution.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
with open("args.json") as _f:
    _args = json.load(_f)
_cls = getattr(_mod, "Solution", None)
_fn = getattr(_cls(), {name!r}) if _cls is not None and hasattr(_cls, {name!r}) else getattr(_mod, {name!r})
_result = _fn(*_args)
sys.__stdout__.write("\\n" + {marker!r} + json.dumps(_result) + "\\n")
sys.__stdout__.flush()
"""


def _functional_args(text: str) -> list:
    return [json.loads(line) for line in text.split("\n") if line.strip()]


async def run_test(code: str, test: dict, fn_name: str | None, timeout: float,
                   client: SandboxClient = CLIENT) -> bool:
    """Run one test in the sandbox; True if it passes."""
    if test.get("testtype") == "functional" or (fn_name and test.get("testtype") != "stdin"):
        marker = f"@@RESULT-{secrets.token_hex(8)}@@"  # unguessable: the program cannot fake it
        files = {"solution.py": code.encode(), "args.json": json.dumps(_functional_args(test["input"])).encode()}
        resp = await client.run(_HARNESS.format(name=fn_name, marker=marker), None, files, timeout)
        run = resp.get("run_result") or {}
        if resp.get("status") != "Success":
            return False
        lines = [line for line in (run.get("stdout") or "").splitlines() if line.startswith(marker)]
        if not lines:
            return False
        got = json.loads(lines[-1][len(marker):])
        try:
            want = json.loads(test["output"])
        except json.JSONDecodeError:
            return False
        return got == json.loads(json.dumps(want))  # tuples and lists compare as JSON does
    stdin = test.get("input", "")
    stdin = stdin if stdin.endswith("\n") else stdin + "\n"
    resp = await client.run(code, stdin, None, timeout)
    run = resp.get("run_result") or {}
    if resp.get("status") != "Success":
        return False
    return outputs_match(run.get("stdout") or "", test.get("output", ""))


async def check(code: str, answer: dict, timeout: float = TEST_TIMEOUT_S, client: SandboxClient = CLIENT) -> bool:
    """True if `code` passes every test of `answer` (stops at the first failure)."""
    tests = answer.get("tests") or []
    if not tests:
        return False
    total = (timeout + 1) * len(tests) + 5

    async def all_pass() -> bool:
        for test in tests:
            if not await run_test(code, test, answer.get("fn_name"), timeout, client):
                return False
        return True

    try:
        return await asyncio.wait_for(all_pass(), total)
    except asyncio.TimeoutError:
        return False


# ------------------------------------------------------------------------------------ env contract

def interact(messages: list[dict]) -> list[dict]:
    return []  # single turn: the reply is the submission


async def reward_fn(messages: list[dict], answer: Any) -> float:
    if isinstance(answer, str):
        answer = json.loads(answer)  # CSV rows keep the dict as JSON text
    reply = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
    code = extract_code(reply)
    if code is None:
        return -FORMAT_COEF
    return 1.0 if await check(code, answer) else 0.0
