"""`math_python`: a verifiers (0.4.0, `verifiers.v1`) taskset of arithmetic problems with a
sandboxed `python` tool.

* Tasks: `stub/data/calc/{train,test}.jsonl` of this repository, 480 in all: two-digit sums the
  tiny stub model can do in its head alternating with products (3 digits x 2 digits) it needs the
  tool for. `data_files` in the taskset config picks others in the same format, e.g. the word
  problems of `stub/data/tool`. The prompt is the problem; the system prompt asks for
  `<answer>N</answer>`.
* Tool: `python(code)` runs the code in the project's bubblewrap sandbox (the service at
  `SANDBOX_URL` if set, else in-process) and returns what it prints (stdout, then stderr),
  cut to `max_output_chars`. The toolset is per rollout (`Task.toolsets`) and allows `max_calls`
  calls per rollout; later calls get an error text.
* Reward `correct_answer`: 1.0 when the last `<answer>...</answer>` of the final reply equals the
  task's answer (spaces, commas and a trailing `.0` ignored), else 0.0.

Importable as `math_python` once `environments/tasksets` is on `sys.path`, which the verifiers
data source and adapter (`environments/verifiers_adapter.py`) arrange.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import verifiers.v1 as vf

REPO = Path(__file__).resolve().parents[3]
STUB_CALC_DATA = REPO / "stub" / "data" / "calc"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
SYSTEM_PROMPT = "Solve the problem. You may run Python with the python tool. Give the final number as <answer>N</answer>."


class PythonToolConfig(vf.ToolsetConfig):
    timeout_s: float = 5.0
    """Wall-clock limit of one run."""
    max_calls: int = 4
    """Tool calls allowed per rollout."""
    max_output_chars: int = 400
    """Longest reply returned to the model (small models have short contexts)."""


class PythonToolset(vf.Toolset[PythonToolConfig]):
    TOOL_PREFIX = None  # advertise the tool as `python`, the name the stub data's protocol uses

    def __init__(self, config: PythonToolConfig) -> None:
        super().__init__(config)
        self.calls = 0  # per rollout: one toolset instance per conversation

    @vf.tool
    async def python(self, code: str) -> str:
        """Run Python code in a sandbox and return what it prints."""
        self.calls += 1
        if self.calls > self.config.max_calls:
            return f"Error: at most {self.config.max_calls} python calls per problem"
        resp = await _client().run(code, None, None, self.config.timeout_s)
        run = resp.get("run_result") or {}
        out = (run.get("stdout") or "") + (run.get("stderr") or "")
        if run.get("status") == "TimeLimitExceeded":
            out += f"\n[timed out after {self.config.timeout_s:g} s]"
        out = out.strip() or "(no output)"
        limit = self.config.max_output_chars
        return out if len(out) <= limit else out[:limit] + "...[truncated]"


_CLIENTS: dict[str, object] = {}  # one sandbox client per process (it pools per event loop)


def _client():
    if "client" not in _CLIENTS:
        envs = str(REPO / "environments")
        if envs not in sys.path:
            sys.path.append(envs)  # the shared sandbox client lives next to the env modules
        from sandbox_client import SandboxClient

        _CLIENTS["client"] = SandboxClient(kind="sandbox")
    return _CLIENTS["client"]


class MathPythonTaskConfig(vf.TaskConfig):
    python: PythonToolConfig = PythonToolConfig()


class MathPythonData(vf.TaskData):
    answer: str


def normalize(text: str) -> str:
    text = str(text).strip().replace(",", "").replace(" ", "")
    return text[:-2] if text.endswith(".0") else text


class MathPythonTask(vf.Task[MathPythonData, vf.State, MathPythonTaskConfig]):
    @classmethod
    def toolsets(cls, config: MathPythonTaskConfig) -> list[vf.Toolset]:
        return [PythonToolset(config.python)]

    @vf.reward
    async def correct_answer(self, task: MathPythonData, trace: vf.Trace) -> float:
        found = ANSWER.findall(trace.last_reply)
        return float(bool(found) and normalize(found[-1]) == normalize(task.answer))


class MathPythonConfig(vf.TasksetConfig):
    task: MathPythonTaskConfig = MathPythonTaskConfig()
    data_files: list[str] = [str(STUB_CALC_DATA / "train.jsonl"), str(STUB_CALC_DATA / "test.jsonl")]
    """JSONL files of rows {"messages": [..., {"role": "user", "content": problem}], "answer": "N"}."""
    prompt_system: str = SYSTEM_PROMPT


class MathPythonTaskset(vf.Taskset[MathPythonTask, MathPythonConfig]):
    def __init__(self, config: vf.TasksetConfig) -> None:
        if not isinstance(config, MathPythonConfig):  # vf.load_taskset(vf.TasksetConfig(id=...)) passes the base
            config = MathPythonConfig.model_validate(config.model_dump(exclude_unset=True))
        super().__init__(config)

    def load(self):
        for path in self.config.data_files:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                for n, line in enumerate(f):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    problem = next(m["content"] for m in reversed(row["messages"]) if m["role"] == "user")
                    yield MathPythonTask(
                        MathPythonData(id=f"{Path(path).stem}-{n}", prompt=problem,
                                       system_prompt=self.config.prompt_system, answer=str(row["answer"])),
                        self.config.task)


__all__ = ["MathPythonTaskset"]
