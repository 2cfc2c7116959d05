#!/usr/bin/env python
"""Teach a copy of the bundled tiny model the search protocol's shapes, for CPU demos and tests.

    .venv/bin/python stub/data/search/warm_model.py --out runs/search-tiny [--steps 250]

The bundled stub/model only ever answers `<answer>N</answer>`: it never searches, and as a judge
it never writes JSON. A short supervised pass (about a minute on 2 idle cores) on
- search QA prompts -> `<search>question</search>`,
- the same prompts followed by search results -> `<answer>target</answer>`,
- judge_ndcg.py's grading prompts -> `{"score": 1}` / `{"score": 0}`,
(with `<search>` and `</search>` added as single tokens) gives a model that often emits a search and
replies with parseable JSON as a judge, so
searchr1/judge runs show the whole mechanism. It is not meant to be good at either.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "environments"))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from train.datasets.tokenize import tokenize_messages  # noqa: E402

HERE = Path(__file__).resolve().parent
SEARCH_TOKENS = ["<search>", "</search>"]


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def examples(rng: random.Random) -> tuple[list[list[dict]], list[list[dict]]]:
    """(policy, judge) conversations whose assistant turns are the targets."""
    import judge_ndcg
    import searchr1

    docs = {d["id"]: d for d in read_jsonl(HERE / "corpus.jsonl")}
    rows = read_jsonl(HERE / "train.jsonl")
    all_targets = [r["answer"]["target"] for r in rows]
    policy, judge = [], []
    for row in rows:
        question = row["messages"][-1]["content"]
        target = row["answer"]["target"]
        search = {"role": "assistant", "content": f"<search>{question.rstrip('?')}</search>"}
        shown = list(row["answer"]["gold_ids"]) + rng.sample(sorted(docs), 2)
        passages = [{"id": i, "title": docs[i]["title"], "contents": f"{docs[i]['title']}\n{docs[i]['text']}"}
                    for i in shown[:3]]
        tool = {"role": "tool", "content": searchr1.format_passages(passages, 300)}
        policy.append(row["messages"] + [search])
        policy.append(row["messages"] + [search, tool, {"role": "assistant", "content": f"<answer>{target}</answer>"}])
        good = rng.random() < 0.5
        candidate = target if good else rng.choice(all_targets)
        score = int(searchr1.normalize(candidate) == searchr1.normalize(target))
        judge.append(judge_ndcg.judge_messages(question, target, candidate)
                     + [{"role": "assistant", "content": json.dumps({"score": score})}])
    return policy, judge


def add_search_tokens(tok, model) -> None:
    """Make <search> and </search> single tokens, as <answer> and </answer> already are in the stub
    tokenizer; each starts as a copy of its <answer> counterpart, so the model closes a search
    where it would close an answer (spelling `</search>` letter by letter is beyond a tiny model)."""
    new = [t for t in SEARCH_TOKENS if t not in tok.get_vocab()]
    if not new:
        return
    tok.add_tokens(new, special_tokens=False)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        for t in new:
            emb[tok.convert_tokens_to_ids(t)] = emb[tok.convert_tokens_to_ids(t.replace("search", "answer"))]


def cached(cache_dir: str | Path, steps: int = 250) -> Path:
    """A warmed model under `cache_dir`, built once per content of this script, the stub data and
    the base model (tests share it across files and sessions)."""
    h = hashlib.sha256(str(steps).encode())
    for f in [Path(__file__), HERE / "train.jsonl", HERE / "corpus.jsonl", ROOT / "stub" / "model" / "model.safetensors",
              ROOT / "environments" / "judge_ndcg.py", ROOT / "environments" / "searchr1.py"]:
        h.update(f.read_bytes())
    out = Path(cache_dir) / f"search-tiny-{h.hexdigest()[:12]}"
    if not (out / "model.safetensors").exists():
        tmp = out.with_name(out.name + ".tmp")
        main(["--out", str(tmp), "--steps", str(steps)])
        tmp.rename(out)  # a half-written model never has the final name
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=str(ROOT / "stub" / "model"))
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    add_search_tokens(tok, model)
    limit = model.config.max_position_embeddings
    parts = [[tokenize_messages(tok, conv) for conv in part] for part in examples(rng)]
    parts = [[(ids, mask) for ids, mask in part if len(ids) <= limit] for part in parts]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        # half policy, half judge in every batch: neither skill drowns the other
        half = args.batch_size // 2
        batch = rng.sample(parts[0], half) + rng.sample(parts[1], args.batch_size - half)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for b, (x, m) in enumerate(batch):
            ids[b, : len(x)] = torch.tensor(x)
            attn[b, : len(x)] = 1
            labels[b, : len(x)] = torch.tensor([t if k else -100 for t, k in zip(x, m)])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        target = labels[:, 1:]
        token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                                                       reduction="none")
        # mean per example, then over examples: an 11-token JSON reply weighs as much as a long answer
        loss = (token_loss.sum(1) / (target != -100).sum(1).clamp(min=1)).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"wrote {args.out} after {args.steps} steps in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
