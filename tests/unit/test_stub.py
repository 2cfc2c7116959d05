"""The bundled stub (stub/build_stub.py): tiny model, tokenizer, chat template and data.

Fast by default (a few seconds). The model rebuild check trains for ~30 s and is marked `slow`:
it runs only when selected, e.g. `pytest -m slow tests/unit/test_stub.py`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, load_file

STUB = ROOT / "stub"
MODEL_DIR = STUB / "model"
DATA_DIR = STUB / "data"
TASKS = ("math", "code", "language", "tool", "arith", "calc")
SPLITS = ("train", "test")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


bs = load_file(STUB / "build_stub.py")


def _rows(task: str, split: str) -> list[dict]:
    with open(DATA_DIR / task / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _ids(tok, messages, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR)


# ------------------------------------------------------------------ model and tokenizer load
def test_model_loads_with_auto_classes(model, tok):
    from transformers import GenerationConfig

    assert type(model).__name__ == "LlamaForCausalLM"
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 5_000_000
    assert model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tok)
    assert next(model.parameters()).dtype.is_floating_point
    gen = GenerationConfig.from_pretrained(MODEL_DIR)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, int) else gen.eos_token_id[0]
    assert eos == tok.convert_tokens_to_ids("<|im_end|>") == model.config.eos_token_id
    assert gen.pad_token_id == tok.pad_token_id


def test_special_and_added_tokens(tok):
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    eos_id = tok.eos_token_id
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [eos_id]
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|im_start|>")]
    assert tok.pad_token_id != eos_id
    for t in bs.ADDED_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, (t, ids)
        assert tok.decode(ids) == t
        assert tok.decode(ids, skip_special_tokens=True) == t  # not special: decode keeps it
    # no BOS or other token is added by encode
    assert tok.encode("1 + 2") == tok.encode("1 + 2", add_special_tokens=False)
    # digits are single tokens
    assert tok.convert_ids_to_tokens(tok.encode("<answer>1234</answer>", add_special_tokens=False)) == [
        "<answer>", "1", "2", "3", "4", "</answer>"]


def test_round_trip_on_data_and_odd_strings(tok):
    texts = [
        "<answer>68</answer>", "<answer> 68 </answer>", "  two  spaces\tand\ttabs\n\n\nend  ",
        "<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(1)\"}}\n</tool_call>",
        "<tool_response>\n408\n</tool_response>", "é ü 中文 ✓", "",
    ]
    for task in TASKS:
        for split in SPLITS:
            for row in _rows(task, split):
                texts += [m["content"] for m in row["messages"]]
                texts.append(row["answer"] if isinstance(row["answer"], str) else json.dumps(row["answer"]))
    for x in texts:
        assert tok.decode(tok.encode(x, add_special_tokens=False)) == x, repr(x)


# ------------------------------------------------------------------ chat template
def test_chat_template_is_chatml(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "23 + 45"},
            {"role": "assistant", "content": "<answer>68</answer>"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n23 + 45<|im_end|>\n"
        "<|im_start|>assistant\n<answer>68</answer><|im_end|>\n")
    assert tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n23 + 45<|im_end|>\n<|im_start|>assistant\n")
    # no default system prompt
    assert tok.apply_chat_template(msgs[1:2], tokenize=False).startswith("<|im_start|>user\n")
    assert tok.chat_template == bs.CHAT_TEMPLATE


def test_chat_template_renders_tools(tok):
    conv = [
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": "print(12 * 34)"}}}]},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "<answer>408</answer>"},
    ]
    text = tok.apply_chat_template(conv, tools=[bs.PYTHON_TOOL_SCHEMA], tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(bs.PYTHON_TOOL_SCHEMA, ensure_ascii=False) in text
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(12 * 34)\"}}"
            "\n</tool_call><|im_end|>\n") in text
    assert "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<answer>408</answer><|im_end|>\n")
    # a system message is folded into the tools block
    text2 = tok.apply_chat_template([{"role": "system", "content": "SYS"}] + conv[:1], tools=[bs.PYTHON_TOOL_SCHEMA],
                                    tokenize=False)
    assert text2.startswith("<|im_start|>system\nSYS\n\n# Tools\n") and text2.count("SYS") == 1


CONVERSATIONS = [
    ([{"role": "user", "content": "23 + 45"}, {"role": "assistant", "content": "<answer>68</answer>"},
      {"role": "user", "content": "And 1 + 1?"}, {"role": "assistant", "content": "<answer>2</answer>"}], None),
    ([{"role": "system", "content": bs.TOOL_SYSTEM_PROMPT},
      {"role": "user", "content": "A train travels at 120 km per hour for 7 hours. How many km does it travel?"},
      {"role": "assistant", "content": "<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(120 * 7)\"}}\n</tool_call>"},
      {"role": "tool", "content": "840"},
      {"role": "tool", "content": "\n  second tool output  \n"},
      {"role": "assistant", "content": "  spaced\n\nreply "},
      {"role": "user", "content": "\nnewline first"},
      {"role": "assistant", "content": "<answer>840</answer>"}], None),
    ([{"role": "user", "content": "What is 12 * 34?"},
      {"role": "assistant", "content": "Let me compute.",
       "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": "print(12 * 34)"}}},
                      {"type": "function", "function": {"name": "python", "arguments": "{\"code\": \"1\"}"}}]},
      {"role": "tool", "content": "408"},
      {"role": "tool", "content": "1"},
      {"role": "assistant", "content": "<answer>408</answer>"}], [bs.PYTHON_TOOL_SCHEMA]),
]


@pytest.mark.parametrize("conv,tools", CONVERSATIONS)
def test_tokenization_is_increasing(tok, conv, tools):
    full = _ids(tok, conv, tools=tools)
    # the rendered text of the full conversation tokenizes to the same ids (no merges across turns)
    assert tok.encode(tok.apply_chat_template(conv, tools=tools, tokenize=False), add_special_tokens=False) == full
    for k in range(1, len(conv)):
        prefix = _ids(tok, conv[:k], tools=tools)
        assert full[: len(prefix)] == prefix, f"prefix of {k} messages is not a token prefix"
        if conv[k]["role"] == "assistant":
            with_prompt = _ids(tok, conv[:k], tools=tools, add_generation_prompt=True)
            assert full[: len(with_prompt)] == with_prompt
            # what follows the generation prompt is the reply's own tokens, then <|im_end|> "\n"
            upto = _ids(tok, conv[: k + 1], tools=tools)
            reply = upto[len(with_prompt):]
            assert reply[-2] == tok.eos_token_id and tok.decode(reply[-1:]) == "\n"
        # tokens of each segment equal the tokens of its text encoded alone
        segment = full[len(prefix):len(_ids(tok, conv[: k + 1], tools=tools))]
        seg_text = tok.apply_chat_template(conv[: k + 1], tools=tools, tokenize=False)[
            len(tok.apply_chat_template(conv[:k], tools=tools, tokenize=False)):]
        assert tok.encode(seg_text, add_special_tokens=False) == segment


# ------------------------------------------------------------------ data
@pytest.mark.parametrize("task", TASKS)
def test_data_files_parse(task):
    for split in SPLITS:
        rows = _rows(task, split)
        assert rows, (task, split)
        for row in rows:
            assert set(row) >= {"messages", "answer"}
            msgs = row["messages"]
            assert isinstance(msgs, list) and msgs
            for m in msgs:
                assert isinstance(m, dict) and m["role"] in ("system", "user") and isinstance(m["content"], str)
            assert msgs[-1]["role"] == "user"
            json.dumps(row["answer"])
    train, test = _rows(task, "train"), _rows(task, "test")
    key = lambda r: json.dumps(r["messages"], sort_keys=True)  # noqa: E731
    assert not ({key(r) for r in train} & {key(r) for r in test}), "test rows leak into train"


def test_math_data():
    train, test = _rows("math", "train"), _rows("math", "test")
    assert len(train) >= 1000 and 200 <= len(test) <= 256
    pairs = {"train": set(), "test": set()}
    for name, rows in (("train", train), ("test", test)):
        for r in rows:
            a, plus, b = r["messages"][0]["content"].split(" ")
            assert plus == "+" and r["answer"] == str(int(a) + int(b))
            pairs[name].add(frozenset((int(a), int(b))))
    assert not (pairs["train"] & pairs["test"]), "test pairs (up to commutativity) leak into train"


def test_code_data_tests_pass_with_reference():
    for split in SPLITS:
        rows = _rows("code", split)
        kinds = {r["answer"]["tests"][0]["testtype"] for r in rows}
        assert kinds == {"stdin", "functional"}, (split, kinds)
        for r in rows:
            ans = r["answer"]
            assert ans["tests"] and all(set(t) == {"input", "output", "testtype"} for t in ans["tests"])
            for t in ans["tests"]:
                if t["testtype"] == "stdin":
                    assert ans["fn_name"] is None
                    assert bs._run_stdin(ans["reference_solution"], t["input"]) == t["output"]
                else:
                    assert ans["starter_code"].startswith(f"def {ans['fn_name']}(")
                    ns: dict = {}
                    exec(ans["reference_solution"], ns)
                    args = [json.loads(x) for x in t["input"].split("\n")] if t["input"] else []
                    assert json.dumps(ns[ans["fn_name"]](*args)) == t["output"]


def test_tool_and_language_data():
    for r in _rows("tool", "train") + _rows("tool", "test"):
        assert r["messages"][0]["role"] == "system" and "<tool_call>" in r["messages"][0]["content"]
        assert r["answer"].lstrip("-").isdigit()
    for r in _rows("language", "train") + _rows("language", "test"):
        op, word = r["messages"][0]["content"].split(": ")
        assert bs.LANG_OPS[op](word) == r["answer"]


def test_arith_data():
    """Every small-number problem once, answers right, test disjoint from train up to commutativity."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    seen = {}
    for split in SPLITS:
        for r in _rows("arith", split):
            what, a, op, b = r["messages"][0]["content"].rstrip("?").rsplit(" ", 3)
            a, b = int(a), int(b)
            assert what == "What is" and 1 <= a <= bs.ARITH_MAX and 1 <= b <= bs.ARITH_MAX and r["answer"] == str(ops[op](a, b))
            seen[(op, a, b)] = split
    assert len(_rows("arith", "test")) == bs.ARITH_TEST and len(seen) == len(_rows("arith", "train")) + bs.ARITH_TEST
    every = {(op, a, b) for op in ops for a in range(1, bs.ARITH_MAX + 1) for b in range(1, bs.ARITH_MAX + 1)
             if op != "-" or a >= b}
    assert set(seen) == every  # none dropped, none invented
    for (op, a, b), split in seen.items():
        if op != "-" and (op, b, a) in seen:
            assert seen[(op, b, a)] == split, (op, a, b)


# ------------------------------------------------------------------ warm start
def test_warm_start_is_almost_there(model, tok):
    rows = _rows("math", "test")
    res = bs.evaluate(model, tok, rows)
    assert res["greedy_format"] >= 0.95
    assert 0.10 <= res["greedy_acc"] <= 0.40, res
    with open(MODEL_DIR / "warmstart_eval.json") as f:
        recorded = json.load(f)
    assert abs(recorded["greedy_acc"] - res["greedy_acc"]) <= 0.05


# ------------------------------------------------------------------ determinism
def _build(out: Path, only: str | None) -> None:
    cmd = [sys.executable, str(STUB / "build_stub.py"), "--out", str(out)] + (["--only", only] if only else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_rebuild_data_and_tokenizer_is_byte_identical(tmp_path):
    _build(tmp_path, "data")
    for task in TASKS:
        for split in SPLITS:
            rel = Path("data") / task / f"{split}.jsonl"
            assert (tmp_path / rel).read_bytes() == (STUB / rel).read_bytes(), rel
    _build(tmp_path, "tokenizer")
    for name in TOKENIZER_FILES:
        assert (tmp_path / "model" / name).read_bytes() == (MODEL_DIR / name).read_bytes(), name


@pytest.mark.slow
def test_rebuild_model_is_byte_identical(tmp_path):
    _build(tmp_path, None)
    for name in ("model.safetensors", "config.json", "generation_config.json", "warmstart_eval.json", *TOKENIZER_FILES):
        assert (tmp_path / "model" / name).read_bytes() == (MODEL_DIR / name).read_bytes(), name
