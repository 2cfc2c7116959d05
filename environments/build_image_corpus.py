"""Write the visual search corpus (slides rendered with PIL) and its question rows.

    .venv/bin/python environments/build_image_corpus.py --out stub/data/visual_search

Deterministic: the same seed gives the same rows and the same pixels (Pillow's bundled font).
Written under `--out`:

corpus.jsonl     {"id": "s000", "title": "Vorel rainfall", "text": <description>, "image": "images/s000.png"}:
                 one row per slide; `text` is what environments/image_search_service.py indexes. It
                 names the place and the measure but no value, so an answer has to be read off the
                 image (the values appear only in the pixels).
images/*.png     128 x 128 slides: a coloured background, the place, the measure and its unit, three
                 years with a value and a bar each.
train.jsonl / test.jsonl
                 {"messages": [system, user], "answer": {"target": "412", "gold_ids": ["s000"]}}: each
                 question is answered by exactly one slide (its `gold_ids`); 2 questions per slide
                 (two of its years); the second question of every other slide is in test (60 train, 20 test).
"""
# No `from __future__ import annotations`: Slide (a dataclass) must also build when this file is
# loaded by path without being registered in sys.modules (tests do).
import argparse
import colorsys
import json
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "stub" / "data" / "visual_search"
SEED = 39
SIZE = 128
YEARS = (2021, 2022, 2023)

SYSTEM_PROMPT = (
    "Find the slide that answers the question. Write <search>query</search> to retrieve slides (images), "
    "<bbox>[x1, y1, x2, y2]</bbox> to zoom into the first slide of your last search (pixel coordinates), "
    "and <search_complete>true</search_complete> once the slides shown answer the question.")

# Invented places: no answer can come from a model's memory.
PLACES = ["Vorel", "Kestra", "Dunmar", "Oshen", "Tarvik", "Lumeth", "Brisca", "Quell"]
# (measure, unit shown on the slide, unit in words, value range)
MEASURES = [
    ("rainfall", "mm", "millimetres", (300, 1500)),
    ("population", "thousand", "thousands of people", (12, 900)),
    ("ore output", "kt", "kilotonnes", (5, 400)),
    ("visitors", "thousand", "thousands of visitors", (20, 800)),
    ("wheat harvest", "kt", "kilotonnes", (10, 300)),
]


@dataclass
class Slide:
    id: str
    place: str
    measure: str
    unit: str
    unit_words: str
    values: dict[int, int]
    background: tuple[int, int, int]

    @property
    def title(self) -> str:
        return f"{self.place} {self.measure}"

    @property
    def description(self) -> str:
        return (f"{self.title}: a bar chart of the yearly {self.measure} of {self.place} in {self.unit_words}, "
                f"{YEARS[0]} to {YEARS[-1]}.")


def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def render_slide(slide: Slide) -> Image.Image:
    """The slide as a SIZE x SIZE RGB image: place, measure (unit), then one row per year with its
    value and a bar proportional to it."""
    img = Image.new("RGB", (SIZE, SIZE), slide.background)
    draw = ImageDraw.Draw(img)
    ink, bar = (20, 20, 30), tuple(max(0, c - 90) for c in slide.background)
    draw.text((6, 4), slide.place, font=_font(15), fill=ink)
    draw.text((6, 23), f"{slide.measure} ({slide.unit})", font=_font(10), fill=ink)
    draw.line((6, 37, SIZE - 6, 37), fill=ink, width=1)
    top = max(slide.values.values())
    for row, year in enumerate(YEARS):
        y = 44 + row * 27
        value = slide.values[year]
        draw.text((6, y), str(year), font=_font(11), fill=ink)
        draw.text((42, y), str(value), font=_font(11), fill=ink)
        width = max(2, round((SIZE - 84) * value / top))
        draw.rectangle((78, y + 2, 78 + width, y + 12), fill=bar)
    return img


def slides(seed: int = SEED) -> list[Slide]:
    rng = random.Random(seed)
    out = []
    for m, (measure, unit, words, (lo, hi)) in enumerate(MEASURES):
        hue = m / len(MEASURES)
        for p, place in enumerate(PLACES):
            light = 0.80 + 0.02 * (p % 4)  # pastel: dark text stays readable
            r, g, b = colorsys.hls_to_rgb(hue, light, 0.55)
            values = {year: rng.randint(lo, hi) for year in YEARS}
            out.append(Slide(f"s{len(out):03d}", place, measure, unit, words, values,
                             (round(r * 255), round(g * 255), round(b * 255))))
    return out


def question(slide: Slide, year: int) -> str:
    return f"What was the {slide.measure} of {slide.place} in {year}, in {slide.unit_words}?"


def rows(all_slides: list[Slide], seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed + 1)
    train, test = [], []
    for n, slide in enumerate(all_slides):
        for k, year in enumerate(rng.sample(YEARS, 2)):
            row = {"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": question(slide, year)}],
                   "answer": {"target": str(slide.values[year]), "gold_ids": [slide.id]}}
            (test if k == 1 and n % 2 == 0 else train).append(row)
    rng.shuffle(train)
    return train, test


def write(out: Path, seed: int = SEED) -> dict[str, int]:
    """Write corpus.jsonl, images/, train.jsonl and test.jsonl under `out`; their sizes."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    all_slides = slides(seed)
    with open(out / "corpus.jsonl", "w") as f:
        for s in all_slides:
            render_slide(s).save(out / "images" / f"{s.id}.png", optimize=True)
            f.write(json.dumps({"id": s.id, "title": s.title, "text": s.description,
                                "image": f"images/{s.id}.png"}) + "\n")
    train, test = rows(all_slides, seed)
    for name, split in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            for row in split:
                f.write(json.dumps(row) + "\n")
    return {"slides": len(all_slides), "train": len(train), "test": len(test)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Render the visual search slides and write their questions.")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder to write (default stub/data/visual_search)")
    p.add_argument("--seed", type=int, default=SEED)
    args = p.parse_args(argv)
    sizes = write(Path(args.out), args.seed)
    print(f"wrote {sizes['slides']} slides, {sizes['train']} train and {sizes['test']} test questions "
          f"to {args.out}")


if __name__ == "__main__":
    main()
