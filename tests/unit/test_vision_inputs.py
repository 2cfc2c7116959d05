"""Images in conversations (train/datasets/vision.py, train/models/vlm.py): image parts in every spelling
become placeholder text and processed images, the multimodal rotary positions equal the model's own, and
bad images are errors that name the row, message and part."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import ROOT, load_file
from train.datasets.loading import DataError, load_rows
from train.datasets.tokenize import prompt_ids
from train.datasets.vision import ImageError, VisionProcessor, has_images, load_image, refuse_images, to_data_url
from train.models.vlm import VisionSpec, image_spans, mrope_positions
from train.parallel.packing import SampleMedia, keyed_ids

build = load_file(ROOT / "stub" / "build_vlm_stub.py")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm")
    model, tok = build.save_random_model(folder)
    return model, tok, VisionProcessor.from_pretrained(str(folder), tok, model.config), folder


def picture(w: int = 60, h: int = 50, colour=(200, 20, 20)) -> Image.Image:
    return Image.new("RGB", (w, h), colour)


def test_every_image_spelling_becomes_its_placeholder_run(vlm, tmp_path):
    _, tok, vision, _ = vlm
    path = tmp_path / "p.png"
    picture().save(path)
    url = to_data_url(picture())
    parts = [{"type": "image", "image": picture()}, {"type": "image", "path": str(path)},
             {"type": "image", "url": url}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "image_url", "image_url": str(path)}, {"type": "text", "text": "What is it?"}]
    shown, images = vision.prepare([{"role": "user", "content": parts}])
    assert len(images) == 5 and all(im.grid.tolist() == [1, 4, 4] for im in images)
    assert len({im.digest for im in images}) == 1  # the same picture five ways: the same pixels
    ids = prompt_ids(tok, shown)
    spans = image_spans(ids, vision.spec.image_token_id)
    assert [b - a for a, b in spans] == [4] * 5  # 16 patches, merged 2 x 2
    assert all(ids[a - 1] == vision.spec.vision_start_id and ids[b] == vision.spec.vision_end_id for a, b in spans)
    assert shown[0]["content"].endswith("What is it?")


def test_mrope_positions_equal_the_models_own(vlm):
    model, tok, vision, _ = vlm
    a, b = vision.process(picture(60, 50)), vision.process(picture(120, 40, (0, 0, 255)))
    messages = [{"role": "user", "content": [{"type": "text", "text": "two:"}, {"type": "image", "image": picture(60, 50)},
                                             {"type": "text", "text": " and "},
                                             {"type": "image", "image": picture(120, 40, (0, 0, 255))}]}]
    shown, images = vision.prepare(messages)
    ids = torch.tensor([prompt_ids(tok, shown) + [5, 6, 7]])
    grids = torch.stack([im.grid for im in images])
    assert grids.tolist() == [a.grid.tolist(), b.grid.tolist()] and a.grid.tolist() != b.grid.tolist()
    reference, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == vision.spec.image_token_id).int(),
                                              image_grid_thw=grids)
    assert torch.equal(mrope_positions(ids[0], grids, vision.spec), reference[:, 0])


def test_mrope_positions_refuse_grids_that_do_not_match_the_placeholders():
    spec = VisionSpec(image_token_id=9, vision_start_id=7, vision_end_id=8, merge=2, patch=14)
    with pytest.raises(ValueError, match="needs 4"):
        mrope_positions([1, 7, 9, 9, 8, 2], torch.tensor([[1, 4, 4]]), spec)
    with pytest.raises(ValueError, match="1 images' placeholder runs but 0"):
        mrope_positions([1, 7, 9, 8], None, spec)


def test_bad_images_are_errors_naming_what_is_wrong(vlm, tmp_path):
    _, _, vision, _ = vlm
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not an image at all")
    huge = tmp_path / "huge.png"
    Image.new("1", (10_000, 10_000)).save(huge)  # 100 megapixels, a few kB on disk
    cases = [({"type": "image", "path": str(tmp_path / "missing.png")}, "does not exist"),
             ({"type": "image", "path": str(corrupt)}, "cannot be decoded"),
             ({"type": "image", "path": str(huge)}, "100,000,000 pixels is over data.max_source_pixels"),
             ({"type": "image", "url": "data:image/png;base64,@@@"}, "not valid base64"),
             ({"type": "image", "url": "data:image/png;base64," + base64.b64encode(b"junk").decode()},
              "cannot be decoded"),
             ({"type": "image", "url": "https://example.com/a.png"}, "not downloaded"),
             ({"type": "image"}, "none of the keys")]
    for part, message in cases:
        with pytest.raises(ImageError, match=message) as got:
            vision.prepare([{"role": "system", "content": "s"}, {"role": "user", "content": [part]}], "data.jsonl: row 7")
        assert "data.jsonl: row 7, message 1 (user), part 0" in str(got.value)


def test_a_text_model_refuses_image_parts_and_keeps_text_lists():
    text = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert refuse_images(text) == (text, []) and not has_images(text)
    with pytest.raises(ImageError, match="part 1 is an image, and the model is text-only"):
        refuse_images([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "image": picture()}]}])


def test_rows_with_image_parts_load_and_bad_parts_name_the_field(tmp_path):
    picture().save(tmp_path / "cat.png")
    good = {"messages": [{"role": "user", "content": [{"type": "image", "path": "cat.png"},
                                                      {"type": "text", "text": "Colour?"}]}], "answer": "red"}
    bad = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "audio"}]}], "answer": 1}
    (tmp_path / "rows.jsonl").write_text(json.dumps(good) + "\n")
    rows = load_rows(str(tmp_path / "rows.jsonl"))
    assert rows[0]["messages"][0]["content"][0]["path"] == str(tmp_path / "cat.png")  # relative to the file
    assert load_image(rows[0]["messages"][0]["content"][0]["path"]).size == (60, 50)
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: row 2: field 'messages\[0\].content\[1\]'"):
        load_rows(str(tmp_path / "bad.jsonl"))


def test_shared_prefix_comparison_stops_where_the_images_differ(vlm):
    _, _, vision, _ = vlm
    red, blue = vision.process(picture()), vision.process(picture(colour=(0, 0, 255)))
    pad = vision.spec.image_token_id
    ids = torch.tensor([1, 2, vision.spec.vision_start_id] + [pad] * 4 + [vision.spec.vision_end_id, 3])

    def media(image):
        return SampleMedia(torch.zeros(3, ids.numel(), dtype=torch.long), (image,), ((3, 7),))

    same = [keyed_ids(ids, media(red)), keyed_ids(ids, media(red))]
    other = keyed_ids(ids, media(blue))
    assert torch.equal(same[0], same[1]) and not torch.equal(same[0], other)
    assert int((same[0] != other).nonzero()[0]) == 3  # the first placeholder: prefixes stop there
    assert torch.equal(keyed_ids(ids, None), ids)


def test_the_bundled_vlm_stub_is_what_its_builder_writes():
    """stub/vlm_model and stub/data/vision exist and hold what the demo trains (docs/vision.md)."""
    folder = ROOT / "stub" / "vlm_model"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and (folder / "preprocessor_config.json").exists()
    first = json.loads((ROOT / "stub" / "data" / "vision" / "test.jsonl").read_text().splitlines()[0])
    part = first["messages"][1]["content"][0]
    assert load_image(part["image"]).size == (build.SIZE, build.SIZE) and first["answer"] in build.COLOURS
    report = json.loads((folder / "warmstart_eval.json").read_text())
    assert report["greedy_test_accuracy"] >= build.WARM_TARGET
    assert sum(p.stat().st_size for p in Path(folder).iterdir()) < 6 << 20  # a few MB at most


def test_pixels_round_trip_as_png_data_urls():
    image = picture(33, 17, (1, 2, 3))
    back = load_image(to_data_url(image))
    assert back.size == (33, 17) and back.getpixel((5, 5)) == (1, 2, 3)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    assert load_image(Image.open(io.BytesIO(buffer.getvalue()))).getpixel((0, 0)) == (1, 2, 3)


def test_logged_conversations_describe_pictures_instead_of_holding_them():
    from train.datasets.vision import loggable

    url = to_data_url(picture())
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "Q"}]},
                {"role": "tool", "content": [{"type": "image", "image": picture(40, 70)},
                                             {"type": "image_url", "image_url": {"url": "pics/a.png"}}]}]
    logged = loggable(messages)
    assert logged[0] is messages[0] and logged[1]["content"][1] == {"type": "text", "text": "Q"}
    assert logged[1]["content"][0]["image"] == f"<data: URL, {len(url)} characters>"
    assert [p["image"] for p in logged[2]["content"]] == ["<Image 40x70>", "pics/a.png"]
    json.dumps(logged)  # plain JSON, no PIL objects
    assert isinstance(messages[2]["content"][0]["image"], Image.Image)  # the env's objects are left as they are
