"""visual_search.py without a service: bbox parsing and clamping, the image part forms the trainer
passes (PIL image, file path, data URL, `image_url`), retrieved ids from list-content tool messages,
and the bundled slides being what environments/build_image_corpus.py writes. (NDCG itself is
judge_ndcg.py's, checked against hand values in tests/unit/test_judge.py.)"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import re

import pytest
from PIL import Image

from conftest import ROOT, load_file
from train.workers.environment import load_env_module

vs = load_env_module("environments/visual_search.py")
DATA = ROOT / "stub" / "data" / "visual_search"


@pytest.mark.parametrize("text, box", [
    ("[1, 2, 3, 4]", (1, 2, 3, 4)),
    (" [ 0,0 , 128, 128 ] ", (0, 0, 128, 128)),
    ("[-5, 2.5, 10., .5e0]", None),  # exponents are not accepted
    ("[-5, 2.5, 10., 7]", (-5, 2.5, 10, 7)),
    ("[+1, 2, 3, 4]", (1, 2, 3, 4)),
])
def test_parse_bbox(text, box):
    if box is None:
        with pytest.raises(vs.BboxError, match="four numbers"):
            vs.parse_bbox(text)
    else:
        assert vs.parse_bbox(text) == box


@pytest.mark.parametrize("text, says", [
    ("1 2 3 4", "four numbers"), ("[1, 2, 3, 4, 5]", "four numbers"), ("[inf, 0, 1, 1]", "four numbers"),
    ("[1, 2, 3, 4]]", "four numbers"), ("[3, 0, 3, 1]", "x1 < x2"), ("[0, 9, 3, 1]", "y1 < y2"),
    ("[0, 0, 1, " + "9" * 400 + "]", "out of range"),
])
def test_parse_bbox_rejects(text, says):
    with pytest.raises(vs.BboxError, match=re.escape(says)):
        vs.parse_bbox(text)


@pytest.mark.parametrize("box, size, out, clamped", [
    ((10, 20, 30, 40), (128, 128), (10, 20, 30, 40), False),
    ((0, 0, 128, 128), (128, 128), (0, 0, 128, 128), False),
    ((-1, -1, 129, 200), (128, 96), (0, 0, 128, 96), True),
    ((1.2, 1.8, 2.1, 3.0), (8, 8), (1, 1, 3, 3), False),  # fractions round outwards
    ((120, 5, 500, 6), (128, 128), (120, 5, 128, 6), True),
])
def test_clamp_box(box, size, out, clamped):
    assert vs.clamp_box(box, size) == (out, clamped)


@pytest.mark.parametrize("box", [(128, 0, 140, 10), (-10, -10, 0, 0), (0, 200, 5, 300)])
def test_clamp_box_outside_is_an_error(box):
    with pytest.raises(vs.BboxError, match="lies outside the 128x128 image"):
        vs.clamp_box(box, (128, 128))


def picture() -> Image.Image:
    img = Image.new("RGB", (20, 10), (200, 10, 10))
    img.putpixel((3, 4), (0, 255, 0))
    return img


def test_every_image_part_form_is_read_and_cropped_alike(tmp_path):
    img = picture()
    path = tmp_path / "p.png"
    img.save(path)
    url = vs.png_data_url(img)
    forms = [{"type": "image", "image": img}, {"type": "image", "image": str(path)},
             {"type": "image", "image": url}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "image", "path": str(path)}, {"type": "image", "url": url}, {"type": "image_url", "image_url": url}]
    for part in forms:
        assert vs.image_of(part).convert("RGB").tobytes() == img.tobytes()
        assert vs.data_url(part).startswith("data:image/png;base64,")
        decoded = Image.open(io.BytesIO(base64.b64decode(vs.data_url(part).split(",", 1)[1])))
        assert decoded.convert("RGB").tobytes() == img.tobytes()
        messages = [{"role": "tool", "doc_ids": ["x1"], "content": [{"type": "text", "text": "[x1] t"}, part]},
                    {"role": "assistant", "content": "<bbox>[2, 3, 5, 6]</bbox>"}]
        crop = vs.crop_message(messages, "[2, 3, 5, 6]")["content"][1]["image"]
        assert crop.size == (3, 3) and crop.convert("RGB").getpixel((1, 1)) == (0, 255, 0)
    remote = {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}
    assert vs.data_url(remote) == "https://example.invalid/a.png"  # passed on as it is
    with pytest.raises(vs.BboxError, match="remote URL"):
        vs.image_of(remote)


def test_crop_target_is_the_first_slide_of_the_latest_search():
    a, b = picture(), Image.new("RGB", (4, 4))
    messages = [{"role": "tool", "doc_ids": ["s1", "s2"], "content": [{"type": "image", "image": a}]},
                {"role": "tool", "doc_ids": ["s3"], "content": [{"type": "image", "image": b}]},
                {"role": "tool", "doc_ids": [], "content": [{"type": "image", "image": a}]},  # a crop
                {"role": "tool", "content": "Cannot crop: ..."}]
    sid, part = vs.crop_target(messages)
    assert sid == "s3" and part["image"] is b
    assert vs.crop_target(messages[2:]) is None


def test_retrieved_ids_from_list_content():
    messages = [{"role": "user", "content": "q"},
                {"role": "tool", "doc_ids": ["s2", "s1"], "content": [{"type": "text", "text": "[s2] a"}]},
                {"role": "tool", "content": [{"type": "text", "text": "[s5] a"}, {"type": "image", "image": None},
                                             {"type": "text", "text": "[s1] b"}]},  # no doc_ids: the [id] lines
                {"role": "tool", "doc_ids": [], "content": [{"type": "text", "text": "Crop [1, 2, 3, 4] of s9"}]}]
    assert vs.retrieved_ids(vs.id_view(messages)) == ["s2", "s1", "s5"]
    assert vs.question_of([{"role": "user", "content": [{"type": "text", "text": "Q?"}]},
                           {"role": "assistant", "content": "x"}, {"role": "user", "content": "later"}]) == "Q?"


def test_generator_request_shape():
    system, user = vs.GeneratorClient.request("Q?", ["data:image/png;base64,AA", "https://h/x.png"])
    assert system == {"role": "system", "content": vs.GENERATOR_SYSTEM}
    assert user["content"] == [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                               {"type": "image_url", "image_url": {"url": "https://h/x.png"}},
                               {"type": "text", "text": "Question: Q?"}]


def test_the_bundled_slides_are_what_the_builder_writes(tmp_path):
    build = load_file(ROOT / "environments" / "build_image_corpus.py")
    assert build.write(tmp_path) == {"slides": 40, "train": 60, "test": 20}
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_text() == (DATA / name).read_text(), name
    for png in sorted((DATA / "images").glob("*.png")):
        with Image.open(png) as bundled, Image.open(tmp_path / "images" / png.name) as rebuilt:
            assert bundled.size == (128, 128) and bundled.tobytes() == rebuilt.tobytes(), png.name
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 1_000_000, total


def test_every_answer_is_on_its_gold_slide():
    build = load_file(ROOT / "environments" / "build_image_corpus.py")
    slides = {s.id: s for s in build.slides()}
    rows = [json.loads(line) for split in ("train", "test") for line in open(DATA / f"{split}.jsonl")]
    for row in rows:
        (gold,) = row["answer"]["gold_ids"]
        s = slides[gold]
        question = row["messages"][-1]["content"]
        year = int(re.search(r"in (\d{4}),", question).group(1))
        assert s.place in question and s.measure in question and row["answer"]["target"] == str(s.values[year])
        assert row["messages"][0] == {"role": "system", "content": build.SYSTEM_PROMPT}
    questions = [r["messages"][-1]["content"] for r in rows]
    assert len(set(questions)) == len(questions) == 80


@pytest.mark.parametrize("source", ["data:image/png;base64,!!not-base64", "data:image/png;base64,AAAA",
                                    "/nonexistent/slide.png"])
def test_an_unreadable_slide_is_a_message_not_a_crash(source):
    messages = [{"role": "tool", "doc_ids": ["s1"], "content": [{"type": "image", "image": source}]},
                {"role": "assistant", "content": "<bbox>[0, 0, 4, 4]</bbox>"}]
    (reply,) = asyncio.run(vs.interact(messages))
    assert reply["role"] == "tool" and reply["content"].startswith("Cannot crop: the slide cannot be read")
    (call,) = [c for c in vs.pop_api_calls() if c["type"] == "crop"]
    assert not call["ok"]
