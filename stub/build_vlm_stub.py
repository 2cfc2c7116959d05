#!/usr/bin/env python
"""Build the bundled vision-language stub: a colour task rendered by code and a tiny Qwen2.5-VL-shaped model.

    .venv/bin/python stub/build_vlm_stub.py                 # data + model into stub/
    .venv/bin/python stub/build_vlm_stub.py --only data     # just stub/data/vision/{train,test}.jsonl
    .venv/bin/python stub/build_vlm_stub.py --out /tmp/s    # somewhere else

The task: a picture of one shape (square, circle or triangle) in one of eight colours on a grey background;
the question asks its colour; the answer is the colour's name (environments/eq.py scores it). Images are
56 x 56 PNGs carried in the rows as data: URLs (4 image tokens each at the stub's pixel budget).

The model (`stub/vlm_model`, ~1 MB): the text stub's tokenizer with `<|vision_start|>`, `<|vision_end|>` and
`<|image_pad|>` added, a 4-layer text model of width 128 and a 2-block vision tower of width 64 whose merger
maps into it, and the image processor's `preprocessor_config.json`. It is warm-started by a short supervised
pass until its greedy test accuracy first reaches WARM_TARGET, so RL has most of the way left to go.

Deterministic for a given machine and package versions (fixed seeds and thread count).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

SEED = 20261127
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 70, 220), "yellow": (235, 215, 30),
           "purple": (140, 50, 180), "orange": (245, 140, 20), "black": (15, 15, 15), "white": (250, 250, 250)}
SHAPES = ("square", "circle", "triangle")
SIZE = 56
QUESTION = "What colour is the {shape}?"
SYSTEM = "Answer with one word."
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
VOCAB_SIZE = 528  # the text stub's 512 + the three vision tokens, rounded up to a multiple of 16
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112
WARM_TARGET = 0.15


def render(colour: str, shape: str, rng: random.Random):
    from PIL import Image, ImageDraw

    grey = rng.randint(110, 160)
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    draw = ImageDraw.Draw(image)
    side = rng.randint(24, 44)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    fill = COLOURS[colour]
    if shape == "square":
        draw.rectangle([x, y, x + side, y + side], fill=fill)
    elif shape == "circle":
        draw.ellipse([x, y, x + side, y + side], fill=fill)
    else:
        draw.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return image


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def row(colour: str, shape: str, rng: random.Random) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": [{"type": "image", "image": data_url(render(colour, shape, rng))},
                                                      {"type": "text", "text": QUESTION.format(shape=shape)}]}],
            "answer": colour}


def build_data(out: Path, n_train: int = 1024, n_test: int = 128) -> None:
    rng = random.Random(SEED)
    pairs = [(c, s) for c in COLOURS for s in SHAPES]
    for split, n in (("train", n_train), ("test", n_test)):
        rows = [row(*pairs[i % len(pairs)], rng) for i in range(n)]
        rng.shuffle(rows)
        path = out / "data" / "vision" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def build_tokenizer(out: Path, text_stub: Path = ROOT / "model"):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(text_stub)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.save_pretrained(out)
    return tok


def vlm_config(tok):
    from transformers import Qwen2_5_VLConfig

    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=352, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1], in_channels=3),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
        video_token_id=ids[2], tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None)


def save_random_model(out: Path, seed: int = 0, text_stub: Path = ROOT / "model"):
    """A random-init tiny VLM folder (weights, config, tokenizer, preprocessor_config.json): what tests use."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, text_stub)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(vlm_config(tok))
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out)
    model.save_pretrained(out)
    return model, tok


def _batch(rows: list[dict], tok, vision, spec):
    """Teacher-forced batch: ids, labels (answer + end-of-turn only), positions [3, B, L], pixels, grids."""
    import torch

    from train.datasets.tokenize import prompt_ids
    from train.models.vlm import mrope_positions

    seqs, labels, pos, images = [], [], [], []
    for r in rows:
        shown, ims = vision.prepare(r["messages"])
        p = prompt_ids(tok, shown)
        a = tok.encode(r["answer"], add_special_tokens=False) + [tok.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
        pos.append(mrope_positions(p + a, torch.stack([im.grid for im in ims]), spec))
        images += ims
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    lab = torch.full((len(seqs), width), -100)
    att = torch.zeros(len(seqs), width, dtype=torch.long)
    positions = torch.zeros(3, len(seqs), width, dtype=torch.long)
    for j, (s, l, q) in enumerate(zip(seqs, labels, pos)):
        ids[j, :len(s)], lab[j, :len(s)], att[j, :len(s)], positions[:, j, :len(s)] = torch.tensor(s), torch.tensor(l), 1, q
    return dict(input_ids=ids, attention_mask=att, position_ids=positions,
                pixel_values=torch.cat([im.pixel_values for im in images]),
                image_grid_thw=torch.stack([im.grid for im in images])), lab


def greedy_accuracy(model, tok, vision, rows: list[dict]) -> float:
    """Greedy accuracy through the trainer's own rollout engine (train/engines/hf.py)."""
    import asyncio

    from train.datasets.tokenize import prompt_ids
    from train.engines.base import SamplingParams
    from train.engines.hf import HFEngine

    engine = HFEngine(model, tok, eos_token_ids=[tok.eos_token_id])
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)

    async def run() -> list:
        jobs = []
        for r in rows:
            shown, ims = vision.prepare(r["messages"])
            jobs.append(engine.generate(prompt_ids(tok, shown), sampling, images=ims))
        return await asyncio.gather(*jobs)

    try:
        gens = asyncio.run(run())
    finally:
        engine.close()
    got = [tok.decode(g.token_ids, skip_special_tokens=True).strip() for g in gens]
    return sum(a == r["answer"] for a, r in zip(got, rows)) / len(rows)


def build_model(out: Path, data: Path, max_steps: int = 400, batch: int = 32, lr: float = 1e-3) -> dict:
    import torch
    from transformers import AutoConfig

    from train.datasets.vision import VisionProcessor

    torch.set_num_threads(2)
    model_dir = out / "vlm_model"
    model, tok = save_random_model(model_dir, seed=SEED)
    vision = VisionProcessor.from_pretrained(str(model_dir), tok, AutoConfig.from_pretrained(model_dir))
    train = [json.loads(x) for x in (data / "vision" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (data / "vision" / "test.jsonl").read_text().splitlines()]
    torch.manual_seed(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(SEED)
    history = [(0, greedy_accuracy(model, tok, vision, test))]
    step = 0
    while step < max_steps and history[-1][1] < WARM_TARGET:
        model.train()
        inputs, labels = _batch(rng.sample(train, batch), tok, vision, vision.spec)
        logits = model(**inputs, use_cache=False).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 2 == 0:
            model.eval()
            history.append((step, greedy_accuracy(model, tok, vision, test)))
            print(f"step {step}: loss {loss.item():.3f}, greedy test accuracy {history[-1][1]:.3f}", flush=True)
    model.eval()
    model.save_pretrained(model_dir)
    report = {"steps": step, "greedy_test_accuracy": history[-1][1], "history": history}
    (model_dir / "warmstart_eval.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT))
    parser.add_argument("--only", choices=("data", "model"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.only in (None, "data"):
        build_data(out)
    if args.only in (None, "model"):
        print(json.dumps(build_model(out, out / "data")))


if __name__ == "__main__":
    main()
