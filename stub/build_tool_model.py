#!/usr/bin/env python
"""Build `stub/tool_model`: a copy of the bundled model (`stub/model`) taught to use the python tool.

    .venv/bin/python stub/build_tool_model.py                 # stub/model -> stub/tool_model
    .venv/bin/python stub/build_tool_model.py --out /tmp/tm   # somewhere else

A short supervised warm start on conversations rendered exactly as the trainer renders the
verifiers taskset `math_python` (its system prompt and the python tool's schema from the adapter's
own rows, tokenized by `train.datasets.tokenize.tokenize_messages`). Problems are drawn like
`stub/data/calc` (two-digit sums, 3x2-digit products) but none of the taskset's own. On a random
TOOL_SHARE of them the reply is a Hermes tool call, then the answer copied from the tool's reply:

    <tool_call>\\n{"name": "python", "arguments": {"code": "print(347 * 28)"}}\\n</tool_call>
    (tool) 9716
    <answer>9716</answer>

and on the rest a direct `<answer>N</answer>`. So the model sometimes calls the tool and mostly
answers in its head, where it gets products never and, under the long tool prompt, few sums right
(`warmstart_eval.json`): RL then has something to learn (call the tool, read its reply). The plain
`stub/model` is untouched, so every figure of the math demo stays what it is.

Deterministic like build_stub.py: fixed seeds, 2 threads, deterministic torch algorithms, a fixed
number of steps; a rebuild on the same machine and package versions gives the same bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

STUB = Path(__file__).resolve().parent
REPO = STUB.parent
for folder in (REPO, STUB):  # the trainer's tokenization and verifiers data source; build_stub.py
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import build_stub as bs  # noqa: E402  (after the path is set)

SEED = bs.SEED + 7
TOOL_SHARE = 0.3  # of the warm-start replies that call the tool (sums and products alike)
N_CONVERSATIONS = 4096
# Copying (problem -> code, tool reply -> answer) takes far more examples than the format does, so
# most of the training is drills: tool conversations without the taskset's 375-token system prompt
# and tool schemas, about 7x cheaper each. Their first token (the choice to call the tool) is not
# trained, so they do not move the 30% call rate learnt from the full conversations.
N_DRILLS = 16384
SFT = dict(batch_size=16, drill_batch_size=128, lr=2e-3, warmup_steps=20, steps=600, final_lr_fraction=0.1)
EVAL_PROMPTS, EVAL_SAMPLES, EVAL_MAX_NEW_TOKENS = 48, 8, 32


def tool_call(question: str) -> str:
    code = f"print({question})"
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


def taskset_prompt() -> tuple[list[dict], list[dict]]:
    """The system message and tool schemas of the verifiers taskset `math_python`, as the trainer
    gets them (verifiers_adapter rows), without the task identity the adapter plants."""
    os.environ.setdefault("VERIFIERS_ENV_ID", "math_python")
    from train.datasets.loading import load_rows

    row = load_rows("verifiers:all?limit=1")[0]
    system = next(m for m in row["messages"] if m["role"] == "system")
    return [{"role": "system", "content": system["content"]}], row["tools"]


def conversation(rng: random.Random, excluded: set[str], use_tool: bool) -> list[dict]:
    while True:
        question, value = bs.calc_problem(rng, rng.randrange(2))
        if question not in excluded:
            break
    messages = [{"role": "user", "content": question}]
    if use_tool:
        messages += [{"role": "assistant", "content": tool_call(question)}, {"role": "tool", "content": str(value)}]
    return messages + [{"role": "assistant", "content": f"<answer>{value}</answer>"}]


def training_sequences(tok, system: list[dict], tools: list[dict], excluded: set[str],
                       n_full: int = N_CONVERSATIONS, n_drills: int = N_DRILLS):
    """(full conversations, drills), each a list of (ids, action mask) as the trainer tokenizes them."""
    from train.datasets.tokenize import tokenize_messages

    rng = random.Random(SEED)
    full = [tokenize_messages(tok, system + conversation(rng, excluded, rng.random() < TOOL_SHARE), tools)
            for _ in range(n_full)]
    drills = []
    for _ in range(n_drills):
        ids, mask = tokenize_messages(tok, conversation(rng, excluded, True))
        mask[mask.index(1)] = 0  # `<tool_call>`: the choice is learnt from the full conversations only
        drills.append((ids, mask))
    return full, drills


def as_tensors(torch, seqs: list[tuple[list[int], list[int]]], pad: int):
    """Right-padded inputs and next-token targets (-100 where the token is not an action)."""
    longest = max(len(ids) for ids, _ in seqs)
    if longest > bs.MODEL_CFG["max_position_embeddings"]:
        raise SystemExit(f"a warm-start conversation has {longest} tokens, more than the model's "
                         f"{bs.MODEL_CFG['max_position_embeddings']} positions")
    X = torch.full((len(seqs), longest), pad, dtype=torch.long)
    Y = torch.full((len(seqs), longest), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(seqs):
        X[i, :len(ids)] = torch.tensor(ids)
        Y[i, :len(ids) - 1] = torch.tensor([t if m else -100 for t, m in zip(ids[1:], mask[1:])])
    return X, Y


class Batches:
    """Endless shuffled minibatches of one tensor pair (a fixed generator: deterministic)."""

    def __init__(self, torch, X, Y, size: int, generator) -> None:
        self.torch, self.X, self.Y, self.size, self.gen = torch, X, Y, size, generator
        self.perm, self.pos = torch.randperm(len(X), generator=generator), 0

    def next(self):
        if self.pos + self.size > len(self.X):
            self.perm, self.pos = self.torch.randperm(len(self.X), generator=self.gen), 0
        idx = self.perm[self.pos:self.pos + self.size]
        self.pos += self.size
        return self.X[idx], self.Y[idx]


def evaluate(model, tok, system: list[dict], tools: list[dict], rows: list[dict]) -> dict:
    """At temperature 1 on the taskset's own problems: how often the first reply is a tool call,
    how often that call's code is exactly `print(<problem>)`, and the direct answers' accuracy;
    greedily: whether the model copies a correct tool reply into its answer."""
    import torch

    from train.datasets.tokenize import prompt_ids

    eos, pad = tok.convert_tokens_to_ids(bs.IM_END), tok.convert_tokens_to_ids(bs.PAD_TOKEN)
    questions = [r["messages"][-1]["content"] for r in rows]
    prompts = [prompt_ids(tok, system + [{"role": "user", "content": q}], tools) for q in questions]
    gen = torch.Generator().manual_seed(SEED)
    reps = [p for p in prompts for _ in range(EVAL_SAMPLES)]
    sampled = bs.generate(model, reps, eos_id=eos, pad_id=pad, temperature=1.0, generator=gen,
                          max_new_tokens=EVAL_MAX_NEW_TOKENS)
    calls = exact = direct = direct_right = 0
    for i, ids in enumerate(sampled):
        row = rows[i // EVAL_SAMPLES]
        text = tok.decode([t for t in ids if t != eos], skip_special_tokens=False)
        if text.startswith("<tool_call>"):
            calls += 1
            exact += text == tool_call(row["messages"][-1]["content"])
        else:
            direct += 1
            direct_right += text == f"<answer>{row['answer']}</answer>"
    followups = [prompt_ids(tok, system + [{"role": "user", "content": q},
                                           {"role": "assistant", "content": tool_call(q)},
                                           {"role": "tool", "content": r["answer"]}], tools)
                 for q, r in zip(questions, rows)]
    greedy = bs.generate(model, followups, eos_id=eos, pad_id=pad, temperature=0.0, max_new_tokens=12)
    copied = sum(tok.decode([t for t in ids if t != eos]) == f"<answer>{r['answer']}</answer>"
                 for ids, r in zip(greedy, rows))
    return {"tool_call_rate": calls / len(sampled), "exact_call_share": exact / max(calls, 1),
            "direct_accuracy": direct_right / max(direct, 1), "copies_tool_reply": copied / len(rows)}


def build(out: Path) -> None:
    torch = bs._setup_torch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = STUB / "model"
    tok = AutoTokenizer.from_pretrained(str(source))
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    system, tools = taskset_prompt()
    calc = [r for split in ("train", "test") for r in bs.read_jsonl(STUB / "data" / "calc" / f"{split}.jsonl")]
    full, drills = training_sequences(tok, system, tools, {r["messages"][-1]["content"] for r in calc})
    pad = tok.convert_tokens_to_ids(bs.PAD_TOKEN)
    gen = torch.Generator().manual_seed(SEED)
    streams = [Batches(torch, *as_tensors(torch, full, pad), SFT["batch_size"], gen),
               Batches(torch, *as_tensors(torch, drills, pad), SFT["drill_batch_size"], gen)]

    opt = torch.optim.AdamW(model.parameters(), lr=SFT["lr"], betas=(0.9, 0.98), weight_decay=0.0)
    steps, warmup, floor = SFT["steps"], SFT["warmup_steps"], SFT["final_lr_fraction"]
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then linear decay to `floor`
        opt, lambda s: min((s + 1) / warmup, 1.0 - (1.0 - floor) * max(0, s - warmup) / (steps - warmup)))
    start = time.time()
    model.train()
    for step in range(1, steps + 1):
        losses = []
        opt.zero_grad(set_to_none=True)
        for stream in streams:  # one batch of each: the loss is their mean
            X, Y = stream.next()
            logits = model(input_ids=X).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), Y.reshape(-1),
                                                     ignore_index=-100) / len(streams)
            loss.backward()
            losses.append(loss.item() * len(streams))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            print(f"[tool sft] step {step} loss full {losses[0]:.4f} drills {losses[1]:.4f} "
                  f"({time.time() - start:.0f}s)", flush=True)
    model.eval()

    res = evaluate(model, tok, system, tools, calc[-EVAL_PROMPTS:])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(source / name, out / name)
    with open(out / "warmstart_eval.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump({k: round(v, 6) for k, v in res.items()} | {"sft_steps": SFT["steps"]}, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"[tool model] saved to {out} after {time.time() - start:.0f}s: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(STUB / "tool_model"), help="output folder (default: stub/tool_model)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    build(Path(args.out))


if __name__ == "__main__":
    main()
