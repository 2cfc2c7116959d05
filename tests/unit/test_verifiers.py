"""verifiers 0.4.0: the `verifiers:` data source, the env adapter (tools over in-process MCP,
per-conversation state, scoring) and a multi-turn rollout through the real rollout worker."""
from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from conftest import ROOT
from train.datasets.loading import DataError, load_rows
from train.datasets.verifiers_source import TASK_FIELD, parse_uri, split_of
from train.engines.base import Generation, SamplingParams
from train.workers.environment import EnvCallError, Environment, load_env_module
from train.workers.rollout import RolloutWorker

ADAPTER = str(ROOT / "environments" / "verifiers_adapter.py")

TINY = textwrap.dedent('''
    import asyncio, itertools
    import verifiers.v1 as vf

    class CounterConfig(vf.ToolsetConfig):
        fail_setup: bool = False

    class Counter(vf.Toolset[CounterConfig]):
        TOOL_PREFIX = None
        def __init__(self, config):
            super().__init__(config)
            self.n = 0
        async def setup(self):
            if self.config.fail_setup:
                raise RuntimeError("setup failed")
        @vf.tool
        async def count(self) -> int:
            """Count the calls of this rollout."""
            self.n += 1
            return self.n
        @vf.tool
        async def nap(self, seconds: float) -> str:
            """Sleep."""
            await asyncio.sleep(seconds)
            return "rested"

    class EchoConfig(vf.ToolsetConfig):
        pass

    class Echo(vf.Toolset[EchoConfig]):
        @vf.tool
        async def say(self, text: str) -> str:
            """Echo the text."""
            return text

    class TinyTaskConfig(vf.TaskConfig):
        counter: CounterConfig = CounterConfig()

    class TinyData(vf.TaskData):
        answer: str

    class TinyTask(vf.Task[TinyData, vf.State, TinyTaskConfig]):
        @classmethod
        def toolsets(cls, config):
            return [Counter(config.counter)]
        @vf.reward
        async def exact(self, task, trace) -> float:
            return float(trace.last_reply == task.answer)
        @vf.reward(weight=0.5)
        async def used_tools(self, trace) -> float:
            return float(len(trace.tool_messages) > 0)

    class TinyConfig(vf.TasksetConfig):
        task: TinyTaskConfig = TinyTaskConfig()
        n: int = 50
        infinite: bool = False

    class TinyTaskset(vf.Taskset[TinyTask, TinyConfig]):
        def __init__(self, config):
            if not isinstance(config, TinyConfig):
                config = TinyConfig.model_validate(config.model_dump(exclude_unset=True))
            super().__init__(config)
            self.INFINITE = self.config.infinite
        @classmethod
        def toolsets(cls, config):
            return [Echo(EchoConfig())]
        def load(self):
            for i in (itertools.count() if self.config.infinite else range(self.config.n)):
                yield TinyTask(TinyData(prompt=f"say {i}", answer=str(i)), self.config.task)

    __all__ = ["TinyTaskset"]
''')


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasksets")
    (root / "tiny_tools").mkdir()
    (root / "tiny_tools" / "__init__.py").write_text(TINY)
    return root


@pytest.fixture
def tiny(tiny_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(tiny_dir))
    monkeypatch.setenv("VERIFIERS_ENV_ID", "tiny_tools")
    monkeypatch.delenv("VERIFIERS_ENV_ARGS", raising=False)
    return monkeypatch


@pytest.fixture
def math_env(monkeypatch):
    monkeypatch.delenv("VERIFIERS_ENV_ID", raising=False)
    monkeypatch.delenv("VERIFIERS_ENV_ARGS", raising=False)
    monkeypatch.delenv("SANDBOX_URL", raising=False)
    return monkeypatch


def call(name: str, args: dict | None = None) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args or {}})}\n</tool_call>'


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# ------------------------------------------------------------------------------------- data source

def test_parse_uri(monkeypatch):
    monkeypatch.delenv("VERIFIERS_EVAL_FRACTION", raising=False)
    assert parse_uri("verifiers:train?limit=32") == ("train", 32, 0.1)
    assert parse_uri("verifiers:test") == ("eval", None, 0.1)
    assert parse_uri("verifiers:all?eval_fraction=0.5") == ("all", None, 0.5)
    for bad, msg in [("verifiers:dev", "unknown split"), ("verifiers:train?limit=0", "positive"),
                     ("verifiers:train?limt=3", "unknown parameter"), ("verifiers:eval?eval_fraction=2", "[0, 1]")]:
        with pytest.raises(DataError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            parse_uri(bad)


def test_math_python_rows_splits_and_tools(math_env):
    train, evals = load_rows("verifiers:train?limit=32"), load_rows("verifiers:eval?limit=32")
    assert len(train) == 32 and 0 < len(evals) <= 32
    keys_train = {r["verifiers"]["key"] for r in load_rows("verifiers:train")}
    keys_eval = {r["verifiers"]["key"] for r in load_rows("verifiers:eval")}
    assert not keys_train & keys_eval and len(keys_train | keys_eval) == 480  # stub/data/calc
    assert all(split_of(k, 0.1) == "eval" for k in keys_eval)
    row = train[0]
    assert [m["role"] for m in row["messages"]] == ["system", "user"]
    assert row["messages"][0][TASK_FIELD]["taskset"] == "math_python"
    assert row["answer"] == row["messages"][0][TASK_FIELD]["data"]["answer"]
    (tool,) = row["tools"]
    assert tool["function"]["name"] == "python" and tool["function"]["parameters"]["required"] == ["code"]


def test_rows_render_tools_in_the_chat_template(math_env, stub_tokenizer):
    row = load_rows("verifiers:train?limit=1")[0]
    text = stub_tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False,
                                              add_generation_prompt=True)
    assert '"name": "python"' in text and "<tool_call>" in text and TASK_FIELD not in text


def test_taskset_errors_are_clear(tiny):
    tiny.setenv("VERIFIERS_ENV_ARGS", '{"infinite": true}')
    with pytest.raises(DataError, match="infinite"):
        load_rows("verifiers:train")
    assert len(load_rows("verifiers:train?limit=5")) == 5
    tiny.setenv("VERIFIERS_ENV_ARGS", '{"nope": 1}')
    with pytest.raises(DataError, match="invalid config"):
        load_rows("verifiers:train")
    tiny.setenv("VERIFIERS_ENV_ARGS", "{bad")
    with pytest.raises(DataError, match="invalid JSON"):
        load_rows("verifiers:train")
    tiny.setenv("VERIFIERS_ENV_ARGS", "{}")
    tiny.setenv("VERIFIERS_ENV_ID", "no_such_taskset_pkg")
    with pytest.raises(DataError, match="no importable taskset"):
        load_rows("verifiers:train")


# ------------------------------------------------------------------------------------------ adapter

def test_math_python_tool_flow_and_scoring(math_env):
    env = load_env_module(ADAPTER)
    row = load_rows("verifiers:train?limit=1")[0]
    answer = row["answer"]
    msgs = [dict(m) for m in row["messages"]]

    async def main():
        msgs.append(assistant(call("python", {"code": "print(6 * 7)"})))
        out = await env.interact(msgs)
        assert [m["content"] for m in out] == ["42"] and out[0]["role"] == "tool"
        assert out[0]["error"] is False  # what feeds the trainer's tools/errors metric
        msgs.extend(out)
        msgs.append(assistant(call("python", {"cod": 1}) + "<tool_call>{oops</tool_call>" + call("nope")))
        out = await env.interact(msgs)
        assert "code" in out[0]["content"] and "Field required" in out[0]["content"]  # bad arguments
        assert out[1]["content"].startswith("Error: invalid JSON")
        assert out[2]["content"].startswith("Error: unknown tool 'nope'")
        assert [m["error"] for m in out] == [True, True, True], [m["content"] for m in out]
        assert len({m["verifiers_conversation"] for m in out}) == 1
        msgs.extend(out)
        assert env.ADAPTER.live_conversations() == 1
        msgs.append(assistant(f"<answer>{answer}</answer>"))
        assert await env.interact(msgs) == []
        assert await env.reward_fn(msgs, answer) == 1.0
        assert env.ADAPTER.live_conversations() == 0  # freed after scoring
        wrong = row["messages"] + [assistant("<answer>-1</answer>")]
        assert await env.reward_fn(wrong, answer) == 0.0

    asyncio.run(main())
    kinds = {c["type"] for c in env.pop_api_calls()}
    assert kinds == {"tool/python"}


def test_per_conversation_state_and_shared_toolsets(tiny):
    env = load_env_module(ADAPTER)
    row = load_rows("verifiers:all?limit=1")[0]
    assert sorted(t["function"]["name"] for t in row["tools"]) == ["count", "echo_say", "nap"]

    async def main():
        a = row["messages"] + [assistant(call("count"))]
        b = row["messages"] + [assistant(call("count"))]
        a += await env.interact(a)
        b += await env.interact(b)
        a.append(assistant(call("count") + call("echo_say", {"text": "hi"})))
        a += await env.interact(a)
        assert [m["content"] for m in a if m["role"] == "tool"] == ["1", "2", "hi"]
        assert [m["content"] for m in b if m["role"] == "tool"] == ["1"]  # its own counter
        assert env.ADAPTER.live_conversations() == 2
        a.append(assistant(row["answer"]))
        assert await env.reward_fn(a, row["answer"]) == pytest.approx(1.5)  # exact + 0.5 * used_tools
        b.append(assistant("wrong"))
        assert await env.reward_fn(b, row["answer"]) == pytest.approx(0.5)
        assert env.ADAPTER.live_conversations() == 0

    asyncio.run(main())


def test_state_is_freed_when_interact_fails(tiny):
    tiny.setenv("VERIFIERS_ENV_ARGS", '{"task": {"counter": {"fail_setup": true}}}')
    env = load_env_module(ADAPTER)
    row = load_rows("verifiers:all?limit=1")[0]
    with pytest.raises(RuntimeError, match="setup failed"):
        asyncio.run(env.interact(row["messages"] + [assistant(call("count"))]))
    assert env.ADAPTER.live_conversations() == 0


def test_tool_timeout_and_env_timeout_free_state(tiny):
    tiny.setenv("VERIFIERS_TOOL_TIMEOUT_S", "0.3")
    env = load_env_module(ADAPTER)
    row = load_rows("verifiers:all?limit=1")[0]
    out = asyncio.run(env.interact(row["messages"] + [assistant(call("nap", {"seconds": 5}))]))
    assert "timed out after 0.3 s" in out[0]["content"]
    asyncio.run(env.ADAPTER.free(out[0]["verifiers_conversation"]))
    # The rollout's own env timeout cancels interact: the state it opened is freed.
    tiny.setenv("VERIFIERS_TOOL_TIMEOUT_S", "30")
    wrapped = Environment(ADAPTER, timeout_s=0.5, max_workers=2, max_turns=3)

    async def main():
        with pytest.raises(EnvCallError, match="timeout"):
            await wrapped.interact(row["messages"] + [assistant(call("nap", {"seconds": 5}))])

    asyncio.run(main())
    assert wrapped.module.ADAPTER.live_conversations() == 0


def test_unscored_conversations_expire(tiny):
    env = load_env_module(ADAPTER)
    row = load_rows("verifiers:all?limit=1")[0]
    msgs = row["messages"] + [assistant(call("count"))]
    msgs += asyncio.run(env.interact(msgs))
    assert env.ADAPTER.live_conversations() == 1
    tiny.setattr(env, "STATE_TTL_S", 0.0)
    asyncio.run(env.ADAPTER.sweep())
    assert env.ADAPTER.live_conversations() == 0
    with pytest.raises(RuntimeError, match="is gone"):
        asyncio.run(env.interact(msgs + [assistant(call("count"))]))


def test_custom_tool_parser(tiny, tmp_path):
    (tmp_path / "my_parser.py").write_text(
        "def parse(text):\n    return [{'name': 'echo_say', 'arguments': {'text': t[5:]}}"
        " for t in text.splitlines() if t.startswith('CALL ')]\n")
    tiny.syspath_prepend(str(tmp_path))
    tiny.setenv("VERIFIERS_TOOL_PARSER", "my_parser:parse")
    env = load_env_module(ADAPTER)
    row = load_rows("verifiers:all?limit=1")[0]
    out = asyncio.run(env.interact(row["messages"] + [assistant("CALL hello")]))
    assert out[0]["content"] == "hello"


# ------------------------------------------------------------------------------ rollout plumbing

class ScriptedEngine:
    """Replies with a python tool call, then, once a tool response is in the prompt, the answer."""

    def __init__(self, tokenizer, answer: str):
        self.tok, self.answer = tokenizer, answer

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        prompt = self.tok.decode(prompt_ids)
        text = f"<answer>{self.answer}</answer>" if "<tool_response>" in prompt else \
            call("python", {"code": f"print({self.answer})"})
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return Generation(ids, [-0.5] * len(ids), "stop")

    def update_weights(self, named_tensors) -> None:
        pass


def test_multi_turn_rollout_masks_tool_tokens(math_env, stub_tokenizer):
    tok = stub_tokenizer
    row = load_rows("verifiers:train?limit=1")[0]
    env = Environment(ADAPTER, timeout_s=60, max_workers=4, max_turns=3)
    worker = RolloutWorker(ScriptedEngine(tok, row["answer"]), env, tok, max_turns=3, env_error_reward=-1.0,
                           max_total_length=512)
    try:
        samples, _ = worker.rollout([row], 2, SamplingParams(max_new_tokens=64), base_seed=0)
    finally:
        worker.loop.close()  # (RolloutWorker.close gathers pending tasks; this engine has none)
    for s in samples:
        assert s.env_error is None and s.reward == 1.0 and s.n_turns == 2
        (event,) = s.events
        assert event["type"] == "tool" and event["messages"][0]["content"] == row["answer"]
        assert [m["role"] for m in s.messages][-3:] == ["assistant", "tool", "assistant"]
        # Exactly the two sampled replies (with their end-of-turn tokens) are actions; the
        # prompt, the tool schemas and the tool response are not.
        actions = tok.decode([i for i, m in zip(s.ids, s.action_mask) if m])
        assert actions == (call("python", {"code": f"print({row['answer']})"}) + "<|im_end|>"
                           + f"<answer>{row['answer']}</answer><|im_end|>")
        masked = tok.decode([i for i, m in zip(s.ids, s.action_mask) if not m])
        assert f"<tool_response>\n{row['answer']}\n</tool_response>" in masked and '"name": "python"' in masked
    assert env.module.ADAPTER.live_conversations() == 0
