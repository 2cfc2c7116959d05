"""Rows from a verifiers taskset: `data.train_data_path="verifiers:train?limit=32"`.

The taskset is named by environment variables, read by this loader and by the env adapter
(`environments/verifiers_adapter.py`) alike, so both see the same tasks:

* `VERIFIERS_ENV_ID`: an importable taskset package (default `math_python`, shipped in
  `environments/tasksets/`, which is put on `sys.path` together with `environments/`);
* `VERIFIERS_ENV_ARGS`: JSON of taskset config fields (`{"task": {"python": {"max_calls": 2}}}`),
  validated by the taskset's own config class.

URI: `verifiers:SPLIT[?limit=N][&eval_fraction=F]`. verifiers 0.4.0 tasksets have no splits, so
this module defines them: a task belongs to `eval` when the first 8 hex digits of
`sha256(task.key)` (the task's stable identity), read as a fraction of 2**32, fall below
`eval_fraction` (`VERIFIERS_EVAL_FRACTION`, default 0.1), and to `train` otherwise; `test` is an
alias of `eval` and `all` takes every task. The rule depends only on each task's content, so the
splits are disjoint and stable when a taskset is reordered or grows. `limit` keeps the first N
tasks of the split in the taskset's order (required for an infinite taskset).

Each row: `messages` (the task's system prompt and prompt; the first message also carries the
task itself under `verifiers_task`, so the env adapter can rebuild and score it without any
lookup), `answer` (the task data's `answer` field when it has one, for logs), `tools` (the JSON
schemas of the taskset's and task's toolsets, rendered by the chat template), and `verifiers`
(taskset id, task idx/key, split).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs

from train.datasets.errors import DataError

ENV_ID_VAR = "VERIFIERS_ENV_ID"
ENV_ARGS_VAR = "VERIFIERS_ENV_ARGS"
EVAL_FRACTION_VAR = "VERIFIERS_EVAL_FRACTION"
DEFAULT_ENV_ID = "math_python"
DEFAULT_EVAL_FRACTION = 0.1
TASK_FIELD = "verifiers_task"  # key in the first message that carries the task
SPLITS = {"train": "train", "eval": "eval", "test": "eval", "all": "all"}

REPO = Path(__file__).resolve().parents[2]
IMPORT_DIRS = (REPO / "environments" / "tasksets", REPO / "environments")


def ensure_import_paths() -> None:
    """Make the shipped tasksets (`math_python`) and the shared sandbox client importable.
    Appended, so an installed package of the same name wins."""
    for path in map(str, IMPORT_DIRS):
        if path not in sys.path:
            sys.path.append(path)


def taskset_settings() -> tuple[str, dict]:
    env_id = os.environ.get(ENV_ID_VAR, "").strip() or DEFAULT_ENV_ID
    raw = os.environ.get(ENV_ARGS_VAR, "").strip() or "{}"
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"{ENV_ARGS_VAR}: invalid JSON ({e.msg}): {raw!r}") from e
    if not isinstance(args, dict):
        raise DataError(f"{ENV_ARGS_VAR}: expected a JSON object of taskset config fields, got {raw!r}")
    return env_id, args


def load_taskset(env_id: str | None = None, args: dict | None = None):
    """The taskset named by `env_id`/`args` (default: the environment variables), its config
    validated by the taskset's own config class."""
    ensure_import_paths()
    import verifiers.v1 as vf

    default_id, default_args = taskset_settings()
    env_id = env_id or default_id
    args = default_args if args is None else args
    try:
        config_cls = vf.taskset_config_type(env_id)
    except ModuleNotFoundError as e:
        raise DataError(f"{ENV_ID_VAR}={env_id!r}: no importable taskset package ({e})") from e
    except (TypeError, AttributeError) as e:
        raise DataError(f"{ENV_ID_VAR}={env_id!r}: not a verifiers taskset package: {e}") from e
    try:
        config = config_cls.model_validate({**args, "id": env_id})
    except Exception as e:  # pydantic ValidationError: name the fields
        raise DataError(f"{ENV_ARGS_VAR}: invalid config for taskset {env_id!r}: {e}") from e
    return vf.load_taskset(config)


# -------------------------------------------------------------------------------------- splits

def parse_uri(uri: str) -> tuple[str, int | None, float]:
    """`verifiers:SPLIT?limit=N&eval_fraction=F` -> (split, limit, eval_fraction)."""
    rest = uri.split(":", 1)[1] if ":" in uri else uri
    name, _, query = rest.partition("?")
    name = name.strip() or "train"
    if name not in SPLITS:
        raise DataError(f"{uri}: unknown split {name!r} (choose one of {', '.join(SPLITS)})")
    params = parse_qs(query, keep_blank_values=True)
    unknown = set(params) - {"limit", "eval_fraction"}
    if unknown:
        raise DataError(f"{uri}: unknown parameter(s) {', '.join(sorted(unknown))} (known: limit, eval_fraction)")
    limit = None
    if "limit" in params:
        try:
            limit = int(params["limit"][-1])
        except ValueError:
            raise DataError(f"{uri}: limit must be a positive integer") from None
        if limit < 1:
            raise DataError(f"{uri}: limit must be a positive integer")
    raw = params["eval_fraction"][-1] if "eval_fraction" in params else os.environ.get(EVAL_FRACTION_VAR, "")
    try:
        fraction = float(raw) if raw.strip() else DEFAULT_EVAL_FRACTION
    except ValueError:
        raise DataError(f"{uri}: eval_fraction must be a number in [0, 1], got {raw!r}") from None
    if not 0.0 <= fraction <= 1.0:
        raise DataError(f"{uri}: eval_fraction must be in [0, 1], got {fraction}")
    return SPLITS[name], limit, fraction


def split_of(task_key: str, eval_fraction: float) -> str:
    bucket = int(hashlib.sha256(task_key.encode()).hexdigest()[:8], 16) / 2**32
    return "eval" if bucket < eval_fraction else "train"


def iter_split(taskset, split: str, limit: int | None, eval_fraction: float) -> Iterator:
    if limit is None and not taskset.bounded:
        raise DataError(f"taskset {taskset.config.id!r} is infinite: give verifiers:{split}?limit=N")
    n = 0
    for task in taskset:
        if split != "all" and split_of(task.key, eval_fraction) != split:
            continue
        yield task
        n += 1
        if limit is not None and n >= limit:
            return


# ----------------------------------------------------------------------------------- tools / rows

def toolset_specs(taskset) -> list:
    """Fresh instances of every toolset a rollout of this taskset sees: the taskset's shared ones,
    then the per-rollout ones of its task type."""
    return list(type(taskset).toolsets(taskset.config)) + list(taskset.task_type().toolsets(taskset.config.task))


async def list_tool_schemas(toolsets: list) -> tuple[list[dict], dict[str, tuple[int, str]]]:
    """OpenAI-style schemas of `toolsets` (listed through an in-process MCP client) and a dispatch
    map: advertised name -> (index into `toolsets`, the tool's own name). Names are prefixed with
    the toolset's `server_name` as verifiers does (none when `TOOL_PREFIX = None`)."""
    from mcp import Client
    from mcp.server.mcpserver import MCPServer

    schemas: list[dict] = []
    dispatch: dict[str, tuple[int, str]] = {}
    for i, toolset in enumerate(toolsets):
        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        async with Client(server) as client:
            listed = (await client.list_tools()).tools
        for tool in listed:
            name = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
            if name in dispatch:
                raise DataError(f"duplicate tool name {name!r} across toolsets")
            dispatch[name] = (i, tool.name)
            schemas.append({"type": "function", "function": {
                "name": name, "description": tool.description or "", "parameters": tool.input_schema}})
    return schemas, dispatch


def run_coroutine(coro) -> Any:
    """Run `coro` to completion from sync code, even when called inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def task_messages(task) -> list[dict]:
    """The task's prompt as chat messages (system prompt first)."""
    from verifiers.v1.types import content_text

    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        for m in data.prompt or []:
            d = m.model_dump(exclude_none=True)
            d["content"] = content_text(m.content) if m.content is not None else ""
            messages.append(d)
    return messages


def task_payload(task, taskset_id: str) -> dict:
    return {"taskset": taskset_id, "type": type(task).__name__, "key": task.key,
            "data": task.data.model_dump(mode="json", exclude_defaults=True)}


def task_row(task, taskset_id: str, tools: list[dict], split: str) -> dict:
    messages = task_messages(task)
    if not messages:
        raise DataError(f"taskset {taskset_id!r}: task {task.data.idx} has no prompt")
    messages[0][TASK_FIELD] = task_payload(task, taskset_id)
    row = {"messages": messages, "answer": getattr(task.data, "answer", None),
           "verifiers": {"taskset": taskset_id, "idx": task.data.idx, "key": task.key, "split": split}}
    if tools:
        row["tools"] = tools
    return row


def load_verifiers_rows(uri: str) -> list[dict]:
    """Return the rows of the verifiers taskset named by ``uri`` (the full ``verifiers:...`` source)."""
    split, limit, fraction = parse_uri(uri)
    taskset = load_taskset()
    taskset_id = taskset.config.id
    schemas, _ = run_coroutine(list_tool_schemas(toolset_specs(taskset)))
    rows = [task_row(task, taskset_id, schemas, split) for task in iter_split(taskset, split, limit, fraction)]
    if not rows:
        raise DataError(f"{uri}: taskset {taskset_id!r} has no {split} tasks (eval_fraction={fraction})")
    return rows
