"""A real trainer run on a verifiers taskset with tools (the seed's launch command itself runs in
tests/integration/test_design_guide.py), marked slow (`pytest -m slow tests/integration/test_verifiers_e2e.py`): the
shipped tool-calling stub (stub/tool_model) on 2 ranks for 2 steps, whose trajectories show tool
calls and sandbox replies. The default suite checks the tool plumbing and loss masks with a
scripted engine (tests/unit/test_verifiers.py)."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT, read_jsonl, run_trainer

TOOL_MODEL = ROOT / "stub" / "tool_model"


def launch(save, model: str, steps: int = 2) -> list[str]:
    return [f"trainer.save_dir={save}", f"actor.model_name={model}",
            # Hydra's override grammar needs the value quoted ('=' inside), as on a shell:
            #   'data.train_data_path="verifiers:train?limit=32"'
            'data.train_data_path="verifiers:train?limit=32"', 'data.test_data_path="verifiers:eval?limit=32"',
            "data.prompts_per_rollout=8", "data.responses_per_prompt=4",
            "rollout.env_path=environments/verifiers_adapter.py", "rollout.max_turns=3",
            "rollout.train_sampling_params.max_new_tokens=40", "rollout.test_sampling_params.max_new_tokens=40",
            f"trainer.total_steps={steps}", f"trainer.test_freq={steps}", "trainer.log_samples=4"]


@pytest.fixture(autouse=True)
def _default_taskset(monkeypatch):
    for var in ("VERIFIERS_ENV_ID", "VERIFIERS_ENV_ARGS", "SANDBOX_URL"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.slow
def test_tool_calls_and_replies_in_a_real_run(tmp_path):  # a minute or more on 2 cores
    save = tmp_path / "run"
    run_trainer(launch(save, str(TOOL_MODEL)), nproc=2, config="grpo", timeout=400)
    metrics = read_jsonl(save / "metrics.jsonl")
    assert all(m.get("env/errors", 0) == 0 for m in metrics)
    assert max(m.get("n_turns/train", 0) for m in metrics) > 1
    events = read_jsonl(save / "trajectories.jsonl")
    stats = [e["stats"] for e in events if e["type"] == "api_stats"]
    assert any(s.get("api/tool/python/count", 0) > 0 for s in stats)  # tool latencies are logged
    samples = [e for e in events if e["type"] == "sample"]
    with_tools = [s for s in samples if s["events"]]
    assert with_tools, "no sampled conversation called a tool"
    s = next((s for s in with_tools if any(m["role"] == "tool" and not m["error"] for m in s["messages"])),
             with_tools[0])  # prefer one where the sandbox ran the model's code; T=1 garbles some calls
    roles = [m["role"] for m in s["messages"]]
    assert "tool" in roles and roles.index("tool") > roles.index("assistant")
    assert all(m.get("verifiers_conversation") for m in s["messages"] if m["role"] == "tool")
    print("\nTRAJECTORY", json.dumps([{k: m[k] for k in ("role", "content")} for m in s["messages"][1:]])[:1500])
