"""Train on any verifiers (0.4.0, `verifiers.v1`) taskset, tools included.

    VERIFIERS_ENV_ID=math_python torchrun --nproc_per_node=2 -m train.trainer.grpo --config-name verifiers

Rows come from the `verifiers:` data source (`train/datasets/verifiers_source.py`, which also
defines how `train`/`eval` map onto a taskset); both read the taskset from `VERIFIERS_ENV_ID` and
`VERIFIERS_ENV_ARGS`. Each row's first message carries its task (`verifiers_task`), and its
`tools` (the toolsets' JSON schemas) reach the chat template.

* `interact(messages)`: parses the tool calls of the last assistant turn (Hermes/Qwen
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` by default; `VERIFIERS_TOOL_PARSER`
  names another, see `PARSERS`), runs each on the taskset's toolsets through an in-process MCP
  client (`VERIFIERS_TOOL_TIMEOUT_S` per call, default 30) and returns one `role: tool` message per
  call. Unparsable calls, unknown tools and bad arguments come back to the model as error text.
  No tool call: `[]`, the episode ends.
* `reward_fn(messages, answer)`: rebuilds the task, turns the conversation into a `vf.Trace`
  (assistant turns after the prompt are `sampled`) and returns `trace.reward` after
  `await task.score(trace)`.

Conversation state. Taskset-level toolsets are shared (one set per event loop). Task-level
toolsets are per rollout, so each conversation that calls a tool gets its own instances. The env
contract passes only `messages`, and all samples of a prompt share the prompt's messages, so the
key is planted by the adapter itself: the first tool call of a conversation creates a random
conversation id, and every tool message it returns carries it under `verifiers_conversation`; the
rollout appends those messages, so later calls and `reward_fn` find it. The state is freed after
scoring, when `interact` raises (a rollout that then ends in an env error never scores), and,
for rollouts that die elsewhere, by expiry: states idle for `VERIFIERS_STATE_TTL_S` (default 900)
or beyond the newest `VERIFIERS_MAX_CONVERSATIONS` (default 4096) are closed.

Tool-call latencies are logged per tool as `api/tool/<name>/...` (`pop_api_calls`).
"""
from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import threading
import time
import uuid
import weakref
from typing import Any, Callable

from train.datasets.verifiers_source import (TASK_FIELD, ensure_import_paths, list_tool_schemas,
                                             load_taskset, run_coroutine, task_messages, toolset_specs)
from train.utils.api_stats import ApiCallRecorder, describe
from train.workers.rubric import RubricScore

CONVERSATION_FIELD = "verifiers_conversation"
TOOL_TIMEOUT_S = float(os.environ.get("VERIFIERS_TOOL_TIMEOUT_S", "30"))
STATE_TTL_S = float(os.environ.get("VERIFIERS_STATE_TTL_S", "900"))
MAX_CONVERSATIONS = int(os.environ.get("VERIFIERS_MAX_CONVERSATIONS", "4096"))
MAX_CALLS_PER_TURN = int(os.environ.get("VERIFIERS_MAX_TOOL_CALLS_PER_TURN", "8"))
MAX_TOOL_OUTPUT_CHARS = int(os.environ.get("VERIFIERS_MAX_TOOL_OUTPUT_CHARS", "4000"))


class ParsedCall:
    # A plain class, not a dataclass: env files are loaded by path, outside sys.modules, where
    # dataclasses cannot resolve postponed annotations.
    def __init__(self, name: str | None, arguments: dict | None, error: str | None = None) -> None:
        self.name, self.arguments = name, arguments
        self.error = error  # why the call could not be parsed (sent back to the model)

    def __repr__(self) -> str:
        return f"ParsedCall({self.name!r}, {self.arguments!r}, error={self.error!r})"


# ------------------------------------------------------------------------------------ tool parsers

HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _call_from_json(body: str) -> ParsedCall:
    expected = 'expected {"name": "<tool>", "arguments": {...}}'
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ParsedCall(None, None, f"invalid JSON in tool call ({e.msg}); {expected}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall(None, None, f"tool call without a name; {expected}")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ParsedCall(obj["name"], None, f"arguments are not valid JSON ({e.msg}); {expected}")
    if not isinstance(args, dict):
        return ParsedCall(obj["name"], None, f"arguments must be a JSON object; {expected}")
    return ParsedCall(obj["name"], args)


def parse_hermes(text: str) -> list[ParsedCall]:
    """Hermes / Qwen2.5 style: each `<tool_call>{json}</tool_call>`; a last, unclosed block counts
    (the model may stop right after the JSON)."""
    return [_call_from_json(body.strip()) for body in HERMES.findall(text or "") if body.strip()]


PARSERS: dict[str, Callable[[str], list[ParsedCall]]] = {"hermes": parse_hermes, "qwen": parse_hermes}


def load_parser(spec: str) -> Callable[[str], list[ParsedCall]]:
    """A registered parser name, or `module:function` returning ParsedCall-like objects or dicts
    with `name` / `arguments` / `error`."""
    if spec in PARSERS:
        return PARSERS[spec]
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"VERIFIERS_TOOL_PARSER={spec!r}: use one of {sorted(PARSERS)} or 'module:function'")
    fn = getattr(importlib.import_module(module), attr)

    def parse(text: str) -> list[ParsedCall]:
        out = []
        for c in fn(text):
            c = c if isinstance(c, ParsedCall) else ParsedCall(c.get("name"), c.get("arguments"), c.get("error"))
            out.append(c)
        return out

    return parse


# --------------------------------------------------------------------------------------- state

class _Conversation:
    def __init__(self, cid: str, loop: asyncio.AbstractEventLoop, own: list) -> None:
        self.cid, self.loop = cid, loop
        self.own = own  # this rollout's toolset instances (closed with the conversation)
        self.servers: list = []  # one in-process MCP server per toolset: shared first, then own
        self.last_used = time.monotonic()


class _SharedTools:
    """Taskset-level toolsets of one event loop, set up once."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.servers: list | None = None


def _server_for(toolset) -> Any:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(toolset.server_name or type(toolset).__name__)
    toolset.register(server)
    return server


def _result_text(result) -> str:
    parts = [getattr(b, "text", None) or str(b) for b in result.content]
    text = "\n".join(parts) if parts else "(no output)"
    if getattr(result, "is_error", False) and not text.lower().startswith("error"):
        text = "Error: " + text
    return text if len(text) <= MAX_TOOL_OUTPUT_CHARS else text[:MAX_TOOL_OUTPUT_CHARS] + "...[truncated]"


def _conversation_id(messages: list[dict]) -> str | None:
    for m in reversed(messages):
        cid = m.get(CONVERSATION_FIELD)
        if cid:
            return cid
    return None


class VerifiersAdapter:
    def __init__(self, recorder: ApiCallRecorder, parser: str | None = None) -> None:
        ensure_import_paths()
        import verifiers.v1 as vf
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import TraceTask

        self.vf, self._state_cls, self._trace_task = vf, state_cls, TraceTask
        self.recorder = recorder
        self.taskset = load_taskset()
        self.taskset_id = self.taskset.config.id
        self.task_cls = self.taskset.task_type()
        self.data_cls = self.task_cls.data_type()
        self.parse = load_parser(parser or os.environ.get("VERIFIERS_TOOL_PARSER", "hermes"))
        self.n_shared = len(type(self.taskset).toolsets(self.taskset.config))
        # Tool names are fixed by the toolset classes: list them once (fresh instances, no sockets).
        self.tools, self.dispatch = run_coroutine(list_tool_schemas(toolset_specs(self.taskset)))
        self._conversations: dict[str, _Conversation] = {}
        self._lock = threading.Lock()  # the store may be touched from several loops (threads)
        self._shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- tasks and traces ---------------------------------------------------------------------
    def task_from(self, messages: list[dict]):
        payload = messages[0].get(TASK_FIELD) if messages else None
        if not isinstance(payload, dict):
            raise ValueError(f"the first message has no '{TASK_FIELD}': rows must come from a verifiers: "
                             "data source (data.train_data_path=verifiers:train?limit=N)")
        if payload.get("taskset") != self.taskset_id:
            raise ValueError(f"row from taskset {payload.get('taskset')!r}, but VERIFIERS_ENV_ID loads "
                             f"{self.taskset_id!r}: set the same taskset for data and env")
        return self.task_cls(self.data_cls.model_validate(payload["data"]), self.taskset.config.task)

    def build_trace(self, task, messages: list[dict]):
        vf = self.vf
        n_prompt = len(task_messages(task))
        tools = [vf.Tool(name=t["function"]["name"], description=t["function"]["description"],
                         parameters=t["function"]["parameters"]) for t in self.tools]
        nodes = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content") or ""
            if role == "system":
                msg = vf.SystemMessage(content=content)
            elif role == "user":
                msg = vf.UserMessage(content=content)
            elif role == "tool":
                msg = vf.ToolMessage(tool_call_id=m.get("tool_call_id") or "", content=content, name=m.get("name"))
            else:
                calls = [vf.ToolCall(id=f"call_{i}_{k}", name=c.name, arguments=json.dumps(c.arguments))
                         for k, c in enumerate(self.parse(content)) if c.error is None]
                msg = vf.AssistantMessage(content=content, tool_calls=calls or None)
            nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=msg, tools=tools if i == 0 else [],
                                        sampled=role == "assistant" and i >= n_prompt))
        return vf.Trace(
            task=self._trace_task(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig()), name="infinite-rl"),
            state=self._state_cls(type(task))(), nodes=nodes, tools=tools)

    # -- conversation state -------------------------------------------------------------------
    async def _shared_servers(self) -> list:
        loop = asyncio.get_running_loop()
        with self._lock:
            shared = self._shared.get(loop)
            if shared is None:
                shared = self._shared[loop] = _SharedTools()
        async with shared.lock:
            if shared.servers is None:
                toolsets = type(self.taskset).toolsets(self.taskset.config)
                for ts in toolsets:
                    await ts.setup()
                shared.servers = [_server_for(ts) for ts in toolsets]
        return shared.servers

    async def _open(self, messages: list[dict]) -> _Conversation:
        task = self.task_from(messages)
        own = list(self.task_cls.toolsets(task.config))
        conv = _Conversation(uuid.uuid4().hex, asyncio.get_running_loop(), own)
        with self._lock:
            self._conversations[conv.cid] = conv
        try:
            for ts in own:
                await ts.setup()
                await ts.setup_task(task)
            conv.servers = await self._shared_servers() + [_server_for(ts) for ts in own]
        except BaseException:
            await asyncio.shield(self.free(conv.cid))  # a failed set-up leaves nothing behind
            raise
        return conv

    async def _close(self, conv: _Conversation) -> None:
        if conv.loop is not asyncio.get_running_loop():
            return  # its loop is gone or elsewhere: drop the references, nothing to await here
        for ts in conv.own:
            try:
                await ts._exit_stack.aclose()  # what the toolset's setup registered for teardown
            except Exception:  # noqa: BLE001 - a failing teardown must not fail the sample
                pass

    async def free(self, cid: str | None) -> None:
        with self._lock:
            conv = self._conversations.pop(cid, None) if cid else None
        if conv is not None:
            await self._close(conv)

    async def sweep(self) -> None:
        """Close conversations whose rollout never scored them (idle too long, or too many)."""
        now = time.monotonic()
        with self._lock:
            by_age = sorted(self._conversations.values(), key=lambda c: c.last_used)
            stale = [c for c in by_age if now - c.last_used > STATE_TTL_S]
            extra = max(0, len(by_age) - len(stale) - MAX_CONVERSATIONS)
            stale += [c for c in by_age if c not in stale][:extra]
            for c in stale:
                self._conversations.pop(c.cid, None)
        for c in stale:
            await self._close(c)

    def live_conversations(self) -> int:
        with self._lock:
            return len(self._conversations)

    # -- the env contract -----------------------------------------------------------------------
    async def interact(self, messages: list[dict]) -> list[dict]:
        await self.sweep()
        if not messages or messages[-1].get("role") != "assistant":
            return []
        calls = self.parse(messages[-1].get("content") or "")
        if not calls:
            return []
        cid = _conversation_id(messages)
        conv = None
        try:
            if cid is None:
                conv = await self._open(messages)
            else:
                with self._lock:
                    conv = self._conversations.get(cid)
                if conv is None:
                    raise RuntimeError(f"conversation state {cid} is gone (expired after VERIFIERS_STATE_TTL_S="
                                       f"{STATE_TTL_S:g} s or freed)")
            conv.last_used = time.monotonic()
            turn = len(messages) - 1
            replies = []
            for k, call in enumerate(calls):
                if k >= MAX_CALLS_PER_TURN:
                    text = f"Error: at most {MAX_CALLS_PER_TURN} tool calls per turn; this one was not run"
                elif call.error is not None:
                    text = f"Error: {call.error}"
                else:
                    text = await self._call_tool(conv, call.name, call.arguments)
                # every failure above comes back as "Error: ..."; the flag feeds the `tools/errors` metric
                replies.append({"role": "tool", "content": text, "tool_call_id": f"call_{turn}_{k}",
                                "name": call.name or "", "error": text.startswith("Error"),
                                CONVERSATION_FIELD: conv.cid})
            conv.last_used = time.monotonic()
            return replies
        except BaseException:
            # This rollout ends in an env error and will never be scored: free its state now.
            if conv is not None:
                await asyncio.shield(self.free(conv.cid))
            raise

    async def _call_tool(self, conv: _Conversation, name: str, arguments: dict) -> str:
        if name not in self.dispatch:
            return f"Error: unknown tool {name!r}; available: {', '.join(self.dispatch) or 'none'}"
        index, raw = self.dispatch[name]
        server = conv.servers[index]
        from mcp import Client

        async def call():
            async with Client(server) as client:  # in-process: no sockets, ~1 ms to connect
                return await client.call_tool(raw, arguments)

        start = time.perf_counter()
        try:
            result = await asyncio.wait_for(call(), TOOL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.recorder.record(f"tool/{name}", time.perf_counter() - start, ok=False,
                                 error=f"timed out after {TOOL_TIMEOUT_S:g} s")
            return f"Error: tool {name!r} timed out after {TOOL_TIMEOUT_S:g} s"
        except Exception as e:  # noqa: BLE001 - a broken tool is the model's observation, not a crash
            self.recorder.record(f"tool/{name}", time.perf_counter() - start, ok=False, error=describe(e))
            return f"Error: tool {name!r} failed: {type(e).__name__}: {e}"
        self.recorder.record(f"tool/{name}", time.perf_counter() - start, ok=not result.is_error,
                             error="the tool returned an error" if result.is_error else None)
        return _result_text(result)

    async def reward_fn(self, messages: list[dict], answer: Any) -> RubricScore:
        try:
            task = self.task_from(messages)
            trace = self.build_trace(task, messages)
            await task.score(trace)
            # The taskset's rubric, criterion by criterion (rubric/<name> in the metrics; train/workers/rubric.py).
            return RubricScore(float(trace.reward), {name: float(r.score) for name, r in trace.rewards.items()})
        finally:
            await asyncio.shield(self.free(_conversation_id(messages)))


# Loaded once per process (the trainer keeps the module): one adapter, one recorder.
RECORDER = ApiCallRecorder()
ADAPTER = VerifiersAdapter(RECORDER)
interact = ADAPTER.interact
reward_fn = ADAPTER.reward_fn
pop_api_calls = RECORDER.pop
