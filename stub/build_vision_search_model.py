#!/usr/bin/env python
"""Build a tiny Qwen2.5-VL-shaped policy that knows the visual search protocol's shape.

    .venv/bin/python stub/build_vision_search_model.py --out runs/vsearch_stub
    .venv/bin/python stub/build_vision_search_model.py --out runs/vsearch_stub --eval   # + the protocol rates

The policy of config/visual_search_stub.yaml (environments/visual_search.py, docs/vision.md "The visual
search agent"). It starts from the VLM stub's recipe (stub/build_vlm_stub.py: the text stub's tokenizer plus
the vision tokens, a 4-layer text model of width 128, a 2-block vision tower) with
- the protocol's tags `<search>`, `</search>`, `<bbox>`, `</bbox>`, `<search_complete>`, `</search_complete>`
  added as single, ordinary tokens (not special: the rollout decodes the policy's turns with
  skip_special_tokens=True and the env must see the tags), and
- 1024 positions instead of 512 (a search reply holds 3 slides of 16 image tokens each plus their lines;
  search + crop + complete conversations reach ~520 tokens),
and is warm-started by a short supervised pass on synthetic episodes over
stub/data/visual_search/train.jsonl:

    (system, question)  ->  <search>population of Quell</search>          (query: words of the question)
    (tool) [s015] Quell population (128x128)<image>[s031] ...<image>...   (the env's own search reply)
    [on half of them]   ->  <bbox>[0, 95, 128, 114]</bbox>                 (the asked year's row)
    (tool) Crop [0, 95, 128, 114] of s015, 128x19 pixels:<image>          (the env's own crop reply)
                        ->  <search_complete>true</search_complete>

The tool messages are built offline from the corpus files by the env's own functions
(`visual_search.search_message` with the search client answered from the corpus: the gold slide first, then
two other slides of the same place, as the service ranks them; `visual_search.crop_message`), and every
conversation is laid out by the trainer's own path (`VisionProcessor.prepare`, then
`tokenize_messages` for the ids and action masks), so the warm start trains exactly the tokens an RL rollout
samples. Each step also trains on "drills" (the question alone -> its search turn), where most of the
copying is learnt.

It stops after WARM["steps"] = 70 steps (deterministic), while the query is still being learnt. `--eval`
measures the policy through the real env (environments/visual_search.py against
environments/image_search_service.py, started here on a free port unless --vsearch_url is given; the
trainer's RolloutWorker and hf engine; reward = NDCG alone, RM_JUDGE_COEF=0) on the 20 test questions, one
greedy and 4 sampled (temperature 1) episodes each, and writes `warmstart_eval.json` into the folder.
Measured with `--probe_every 10` (2 CPU cores; searched / completed / cropped / NDCG of sampled episodes):

    step 50: 0.96 / 0.55 / 0.09 / 0.05     greedy NDCG 0.03
    step 60: 0.96 / 0.76 / 0.18 / 0.14     greedy NDCG 0.09
    step 70: 1.00 / 0.84 / 0.25 / 0.25     greedy NDCG 0.28 (searched 0.95, completed 0.95)   <- the default
    step 80: 0.98 / 0.80 / 0.33 / 0.46     greedy NDCG 0.80
    step 90: 0.99 / 0.85 / 0.29 / 0.74     greedy NDCG 1.00

So at 70 steps the policy searches and completes most of the time but its queries mostly name the wrong
place or measure: NDCG has room, which GSPO then takes (docs/vision.md).

Deterministic for a given machine and package versions (fixed seeds, 2 threads).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import random
import re
import sys
import time
from pathlib import Path

STUB = Path(__file__).resolve().parent
REPO = STUB.parent
for folder in (REPO, STUB, REPO / "environments"):  # the trainer; build_vlm_stub.py; the env module
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import build_vlm_stub as bv  # noqa: E402  (after the path is set)

DATA = STUB / "data" / "visual_search"
ENV = REPO / "environments" / "visual_search.py"
SEED = 20261203
TAGS = ["<search>", "</search>", "<bbox>", "</bbox>", "<search_complete>", "</search_complete>"]
STOP = ["</search>", "</bbox>", "</search_complete>"]  # the preset's stop strings: a turn ends with its tag
MAX_POSITIONS = 1024
MAX_TURNS = 3  # search, bbox, search_complete
MAX_NEW_TOKENS = 48
CROP_SHARE = 0.5  # of the warm-start episodes that zoom into the asked year's row before completing
VARIANTS = 4  # warm-start episodes per training question (distractor slides and crop drawn per variant)
# Copying the query out of the question takes far more examples than the protocol does, so each step also
# trains on drills: the question alone (no system prompt, no tool reply, no image: ~60 tokens, against ~480
# for a whole episode) followed by its search turn.
WARM = dict(steps=70, batch=8, drills=32, lr=2e-3, warmup=10)
EVAL_SAMPLES = 4  # sampled episodes per test question (and one greedy)
QUESTION = re.compile(r"What was the (?P<measure>.+?) of (?P<place>.+?) in (?P<year>\d{4}), in .+\?$")


# ------------------------------------------------------------------------------------ episodes

def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def query_of(question: str) -> str:
    """The search query: the question's measure and place words ("population of Quell")."""
    m = QUESTION.match(question)
    if not m:
        raise ValueError(f"not a stub question: {question!r}")
    return f"{m['measure']} of {m['place']}"


def row_bbox(question: str) -> list[int]:
    """The pixel box of the asked year's row on its slide (environments/build_image_corpus.py's layout:
    rows at y = 44 + 27 k for 2021, 2022, 2023)."""
    y = 44 + 27 * (int(QUESTION.match(question)["year"]) - 2021)
    return [0, y - 3, 128, y + 16]


class CorpusSearch:
    """Stands in for the image service's client while the warm-start episodes are built: the gold slide
    first, then `k - 1` other slides of the same place (the service ranks those next), as the service's JSON
    (`id`, `title`, `score`, `width`, `height`, base64 PNG `image`) from the corpus files."""

    def __init__(self, corpus: Path = DATA / "corpus.jsonl") -> None:
        self.docs = {d["id"]: d for d in read_jsonl(corpus)}
        self.folder = corpus.parent
        self.next_ids: list[str] = []

    def result(self, sid: str, score: float) -> dict:
        doc = self.docs[sid]
        png = (self.folder / doc["image"]).read_bytes()
        from PIL import Image

        with Image.open(io.BytesIO(png)) as image:
            width, height = image.size
        return {"id": sid, "title": doc.get("title", ""), "score": score, "width": width, "height": height,
                "image": base64.b64encode(png).decode("ascii")}

    def ranking(self, gold: str, rng: random.Random, k: int = 3) -> list[str]:
        place = self.docs[gold]["title"].split()[0]
        same = sorted(i for i, d in self.docs.items() if i != gold and d["title"].split()[0] == place)
        return [gold] + rng.sample(same, k - 1)

    async def search(self, query: str, top_k: int | None = None) -> list[dict]:
        return [self.result(sid, 0.8 - 0.1 * n) for n, sid in enumerate(self.next_ids)]


def episode(row: dict, search: CorpusSearch, rng: random.Random, crop: bool) -> list[dict]:
    """One protocol-following conversation (PIL images in the tool messages), its tool messages made by the
    env's own functions."""
    import visual_search as vs

    question = row["messages"][-1]["content"]
    messages = [dict(m) for m in row["messages"]]
    search.next_ids = search.ranking(row["answer"]["gold_ids"][0], rng)
    original, vs.search_client = vs.search_client, search
    try:
        messages.append({"role": "assistant", "content": f"<search>{query_of(question)}</search>"})
        messages.append(asyncio.run(vs.search_message(query_of(question))))
    finally:
        vs.search_client = original
    if crop:
        box = "[" + ", ".join(map(str, row_bbox(question))) + "]"
        messages.append({"role": "assistant", "content": f"<bbox>{box}</bbox>"})
        messages.append(vs.crop_message(messages, box))
    messages.append({"role": "assistant", "content": "<search_complete>true</search_complete>"})
    return messages


def tokenized(messages: list[dict], tok, vision) -> dict:
    """The conversation as the rollout lays it out: ids, action mask, processed images."""
    from train.datasets.tokenize import tokenize_messages

    shown, images = vision.prepare(messages)
    ids, mask = tokenize_messages(tok, shown)
    return {"ids": ids, "mask": mask, "images": images}


def training_set(tok, vision, rows: list[dict], seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    search = CorpusSearch()
    return [tokenized(episode(row, search, rng, rng.random() < CROP_SHARE), tok, vision)
            for row in rows for _ in range(VARIANTS)]


def drill_set(tok, rows: list[dict]) -> list[dict]:
    """(question) -> <search>query</search>: ids and action masks as the trainer tokenizes them, no images."""
    from train.datasets.tokenize import tokenize_messages

    out = []
    for row in rows:
        question = row["messages"][-1]["content"]
        ids, mask = tokenize_messages(tok, [{"role": "user", "content": question},
                                            {"role": "assistant", "content": f"<search>{query_of(question)}</search>"}])
        out.append({"ids": ids, "mask": mask, "images": []})
    return out


def batch(items: list[dict], pad_id: int, spec):
    """Right-padded inputs with Qwen2-VL's multimodal positions and the images' pixels; labels on the
    actions (action mask 1), -100 elsewhere."""
    import torch

    from train.models.vlm import mrope_positions

    width = max(len(x["ids"]) for x in items)
    ids = torch.full((len(items), width), pad_id)
    labels = torch.full((len(items), width), -100)
    attention = torch.zeros(len(items), width, dtype=torch.long)
    positions = torch.zeros(3, len(items), width, dtype=torch.long)
    images = []
    for j, x in enumerate(items):
        n = len(x["ids"])
        ids[j, :n] = torch.tensor(x["ids"])
        labels[j, :n] = torch.tensor([t if m else -100 for t, m in zip(x["ids"], x["mask"])])
        attention[j, :n] = 1
        grids = torch.stack([im.grid for im in x["images"]]) if x["images"] else None
        positions[:, j, :n] = mrope_positions(x["ids"], grids, spec)
        images += x["images"]
    inputs = dict(input_ids=ids, attention_mask=attention, position_ids=positions)
    if images:
        inputs.update(pixel_values=torch.cat([im.pixel_values for im in images]),
                      image_grid_thw=torch.stack([im.grid for im in images]))
    return inputs, labels


# --------------------------------------------------------------------------------------- model

def save_policy(out: Path, seed: int = SEED):
    """A random-init policy folder: the VLM stub's tokenizer + the tags, its config with MAX_POSITIONS,
    the image processor. Returns (model, tokenizer)."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    tok = bv.build_tokenizer(out)
    tok.add_tokens([t for t in TAGS if t not in tok.get_vocab()], special_tokens=False)
    if len(tok) > bv.VOCAB_SIZE:
        raise SystemExit(f"the tokenizer has {len(tok)} tokens, more than the model's {bv.VOCAB_SIZE}")
    tok.save_pretrained(out)
    config = bv.vlm_config(tok)
    config.text_config.max_position_embeddings = MAX_POSITIONS
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2VLImageProcessorPil(min_pixels=bv.MIN_PIXELS, max_pixels=bv.MAX_PIXELS).save_pretrained(out)
    model.save_pretrained(out)
    return model, tok


def warm_start(out: Path, steps: int = WARM["steps"], probe=None, probe_every: int = 0) -> dict:
    """Write the policy to `out` and warm-start it for `steps` steps; `probe(step)` is called every
    `probe_every` steps with the model saved in `out` (to watch the protocol rates while choosing `steps`)."""
    import torch
    from transformers import AutoConfig

    from train.datasets.vision import VisionProcessor

    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    model, tok = save_policy(out)
    vision = VisionProcessor.from_pretrained(str(out), tok, AutoConfig.from_pretrained(out))
    start = time.perf_counter()
    rows = read_jsonl(DATA / "train.jsonl")
    data, drills = training_set(tok, vision, rows), drill_set(tok, rows)
    longest = max(len(x["ids"]) for x in data)
    if longest > MAX_POSITIONS:
        raise SystemExit(f"a warm-start episode has {longest} tokens, more than {MAX_POSITIONS} positions")
    print(f"{len(data)} warm-start episodes, {min(len(x['ids']) for x in data)}-{longest} tokens "
          f"({time.perf_counter() - start:.1f}s)", flush=True)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / WARM["warmup"], 1.0))
    model.train()
    losses = []
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        parts = []
        for items in (rng.sample(data, WARM["batch"]), rng.choices(drills, k=WARM["drills"])):
            inputs, labels = batch(items, tok.pad_token_id, vision.spec)  # one forward each: drills are short
            logits = model(**inputs, use_cache=False).logits[:, :-1].float()
            part = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            (part / 2).backward()  # the loss: the mean of the episodes' and the drills' token means
            parts.append(part.item())
        loss = torch.tensor(sum(parts) / 2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(round(loss.item(), 4))
        if step % 10 == 0 or step == steps:
            print(f"step {step}: loss {loss.item():.3f} (episodes {parts[0]:.3f}, drills {parts[1]:.3f}; "
                  f"{time.perf_counter() - start:.0f}s)", flush=True)
        if probe is not None and probe_every and step % probe_every == 0 and step < steps:
            model.eval()
            model.save_pretrained(out)
            probe(step)
            model.train()
    model.eval()
    model.save_pretrained(out)
    report = {"warm_steps": steps, "episodes": len(data), "max_tokens": longest, "loss": losses[-1],
              "seconds": round(time.perf_counter() - start, 1)}
    (out / "warmstart_eval.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def cached(cache_dir: str | Path, steps: int = WARM["steps"]) -> Path:
    """The policy built once under `cache_dir` per content of this script, build_vlm_stub.py, the env, the
    text stub's tokenizer and the slides (tests share it across files and sessions)."""
    import hashlib

    h = hashlib.sha256(str(steps).encode())
    for f in [Path(__file__), STUB / "build_vlm_stub.py", ENV, STUB / "model" / "tokenizer.json",
              DATA / "corpus.jsonl", DATA / "train.jsonl", *sorted((DATA / "images").glob("*.png"))]:
        h.update(f.read_bytes())
    out = Path(cache_dir) / f"vsearch-{h.hexdigest()[:12]}"
    if not (out / "model.safetensors").exists():
        tmp = out.with_name(out.name + ".tmp")
        warm_start(tmp, steps)
        tmp.rename(out)  # a half-written policy never has the final name
    return out


# ------------------------------------------------------------------------------------ evaluation

@contextlib.contextmanager
def image_service(log: Path):
    """environments/image_search_service.py on the bundled slides, on a free 127.0.0.1 port; its URL."""
    from train.utils.services import free_port, running_all

    port = free_port()
    cmd = [sys.executable, str(REPO / "environments" / "image_search_service.py"), "--corpus_path",
           str(DATA / "corpus.jsonl"), "--top_k", "3", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with running_all({"the image service": (cmd, url + "/health", log)}, cwd=REPO,
                     env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}):
        yield url


def episode_stats(messages: list[dict], answer: dict) -> dict:
    """What one finished episode did: searched, cropped (a valid crop came back), completed, and the NDCG the
    env scores (0 when it did not complete, as VSEARCH_REQUIRE_COMPLETE=1)."""
    import visual_search as vs
    from judge_ndcg import gold_ids, ndcg_at_k, retrieved_ids

    tools = [m for m in messages if m.get("role") == "tool"]
    done = vs.completed(messages)
    ndcg = ndcg_at_k(retrieved_ids(vs.id_view(messages)), gold_ids(answer),
                     int(os.environ.get("VSEARCH_NDCG_K", "3"))) if done else 0.0
    return {"searched": any(m.get("doc_ids") for m in tools), "cropped": any("crop_of" in m for m in tools),
            "completed": done, "ndcg": ndcg,
            "protocol": done and any(m.get("doc_ids") for m in tools)}


def summarize(stats: list[dict]) -> dict:
    n = max(len(stats), 1)
    return {"episodes": len(stats), **{k: round(sum(float(s[k]) for s in stats) / n, 4)
                                        for k in ("searched", "cropped", "completed", "protocol", "ndcg")}}


def evaluate(folder: Path, url: str, rows: list[dict], samples: int = EVAL_SAMPLES) -> dict:
    """Greedy (one per question) and sampled (temperature 1, `samples` per question) episodes through the
    trainer's RolloutWorker + hf engine and the real env against the image service at `url`."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from train.datasets.vision import VisionProcessor
    from train.engines.base import SamplingParams
    from train.engines.hf import HFEngine
    from train.workers.environment import Environment
    from train.workers.rollout import RolloutWorker

    os.environ.update(VSEARCH_URL=url, RM_JUDGE_COEF="0", RM_NDCG_COEF="1", VSEARCH_REQUIRE_COMPLETE="1")
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(folder)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    vision = VisionProcessor.from_pretrained(str(folder), tok, AutoConfig.from_pretrained(folder))
    engine = HFEngine(model, tok, eos_token_ids=[tok.eos_token_id], seed=SEED)
    env = Environment(str(ENV), timeout_s=60, max_workers=4, max_turns=MAX_TURNS)
    worker = RolloutWorker(engine, env, tok, max_turns=MAX_TURNS, env_error_reward=0.0,
                           max_total_length=MAX_POSITIONS, vision=vision)
    out = {}
    try:
        for name, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, samples)):
            params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, stop=tuple(STOP))
            done, seconds = worker.rollout(rows, n, params, base_seed=SEED)
            stats = [episode_stats(s.messages, s.answer) for s in done]
            out[name] = {**summarize(stats), "env_errors": sum(bool(s.env_error) for s in done),
                         "reward_mean": round(sum(s.reward for s in done) / len(done), 4),
                         "seconds": round(seconds, 1)}
            print(f"{name}: {json.dumps(out[name])}", flush=True)
    finally:
        worker.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the policy folder to write (e.g. runs/vsearch_stub)")
    parser.add_argument("--steps", type=int, default=WARM["steps"], help="warm-start steps (default %(default)s)")
    parser.add_argument("--eval", action="store_true", help="measure the protocol rates through the real env")
    parser.add_argument("--eval_only", action="store_true", help="only measure (the folder exists)")
    parser.add_argument("--vsearch_url", help="a running image service (default: start one on a free port)")
    parser.add_argument("--probe_every", type=int, default=0,
                        help="also measure the rates every N warm-start steps (to choose --steps)")
    parser.add_argument("--split", default="test", choices=("train", "test"), help="questions to evaluate on")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    rows = read_jsonl(DATA / f"{args.split}.jsonl")
    with contextlib.ExitStack() as stack:
        url = None
        if args.eval or args.eval_only or args.probe_every:
            out.mkdir(parents=True, exist_ok=True)
            url = args.vsearch_url or stack.enter_context(image_service(out / "image_service.log"))
        probes = {}

        def probe(step: int) -> None:
            probes[step] = evaluate(out, url, rows)

        report = (json.loads((out / "warmstart_eval.json").read_text()) if args.eval_only
                  else warm_start(out, args.steps, probe, args.probe_every))
        if probes:
            report["probes"] = {"split": args.split, **probes}
        if args.eval or args.eval_only:
            report["eval"] = {"split": args.split, **evaluate(out, url, rows)}
        (out / "warmstart_eval.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
