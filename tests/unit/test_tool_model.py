"""The tool-calling stub (stub/tool_model, built by stub/build_tool_model.py) and its data
(stub/data/calc, the default tasks of the verifiers taskset `math_python`). That the shipped model
really calls the tool in the seed's launch command is tests/integration/test_design_guide.py::test_launch_command."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import pytest

from conftest import ROOT, load_file

STUB = ROOT / "stub"
TOOL_MODEL = STUB / "tool_model"


btm = load_file(STUB / "build_tool_model.py")
bs = btm.bs
CALL = re.compile(r"print\((\d+) ([+*]) (\d+)\)")


def _calc_rows() -> list[dict]:
    return [r for split in ("train", "test") for r in bs.read_jsonl(STUB / "data" / "calc" / f"{split}.jsonl")]


def value(a: str, op: str, b: str) -> int:
    return int(a) + int(b) if op == "+" else int(a) * int(b)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOOL_MODEL)


@pytest.fixture(scope="module")
def taskset_prompt():
    return btm.taskset_prompt()  # (system message, tool schemas) of the taskset's rows


def test_calc_data_sums_and_products_alternate():
    rows = _calc_rows()
    assert len(rows) == bs.CALC_TRAIN + bs.CALC_TEST and len({r["messages"][0]["content"] for r in rows}) == len(rows)
    for i, r in enumerate(rows[:bs.CALC_TRAIN]):
        a, op, b = r["messages"][0]["content"].split(" ")
        assert op == "+*"[i % 2] and r["answer"] == str(value(a, op, b))
        digits = (2, 2) if op == "+" else (3, 2)
        assert (len(a), len(b)) == digits, r


def test_warm_start_conversations_are_the_trainers_tokens(tok, taskset_prompt):
    """Full conversations: the taskset's system prompt and tool schema, the choice to call trained
    on ~TOOL_SHARE of them; drills: tool conversations without the prompt whose choice token is not
    trained; every tool call is a Hermes call whose code prints the right value;
    none of the taskset's own problems is used."""
    from train.datasets.tokenize import tokenize_messages

    system, tools = taskset_prompt
    excluded = {r["messages"][0]["content"] for r in _calc_rows()}
    full, drills = btm.training_sequences(tok, system, tools, excluded, n_full=200, n_drills=50)
    call_id = tok.convert_tokens_to_ids("<tool_call>")
    first_actions = [ids[mask.index(1)] for ids, mask in full]
    assert 0.2 <= first_actions.count(call_id) / len(full) <= 0.4
    prompt_len = len(tokenize_messages(tok, system + [{"role": "user", "content": "1 + 1"}], tools)[0])
    assert all(len(ids) > prompt_len for ids, _ in full) and all(len(ids) < prompt_len for ids, _ in drills)
    for ids, mask in drills:
        first = mask.index(1)
        assert ids[first - 1] == call_id and mask[first - 1] == 0  # the choice is not trained
    rng = random.Random(0)
    for _ in range(20):
        messages = btm.conversation(rng, excluded, True)
        assert messages[0]["content"] not in excluded
        head, body = messages[1]["content"].split("\n", 1)
        call = json.loads(body.removesuffix("\n</tool_call>"))
        a, op, b = CALL.fullmatch(call["arguments"]["code"]).groups()
        assert head == "<tool_call>" and call["name"] == "python" and messages[2]["content"] == str(value(a, op, b))
        assert messages[0]["content"] == f"{a} {op} {b}"
        assert messages[3]["content"] == f"<answer>{messages[2]['content']}</answer>"


def test_shipped_tool_model_matches_its_record(taskset_prompt):
    """Same tokenizer as stub/model; re-evaluated now, it behaves as its warmstart_eval.json says:
    it calls the tool sometimes (not always), and when it does the code is mostly exactly right."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (TOOL_MODEL / name).read_bytes() == (STUB / "model" / name).read_bytes(), name
    bs._setup_torch()
    tok = AutoTokenizer.from_pretrained(TOOL_MODEL)
    model = AutoModelForCausalLM.from_pretrained(TOOL_MODEL)
    res = btm.evaluate(model, tok, *taskset_prompt, _calc_rows()[-btm.EVAL_PROMPTS:])
    recorded = json.loads((TOOL_MODEL / "warmstart_eval.json").read_text())
    for key, got in res.items():
        assert abs(recorded[key] - got) <= 0.02, (key, recorded[key], got)
    assert 0.1 <= res["tool_call_rate"] <= 0.5 and res["exact_call_share"] >= 0.5, res


@pytest.mark.slow
def test_rebuild_tool_model_is_byte_identical(tmp_path):  # ~10 min on 2 cores
    proc = subprocess.run([sys.executable, str(STUB / "build_tool_model.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for name in ("model.safetensors", "config.json", "generation_config.json", "warmstart_eval.json"):
        assert (tmp_path / name).read_bytes() == (TOOL_MODEL / name).read_bytes(), name
