"""Images in conversations: from message parts to the pixels a vision-language model takes.

A message's `content` may be a list of parts. Image parts, in any of these spellings:
    {"type": "image", "image": <PIL image | path | data: URL>}      (also "path" or "url" instead of "image")
    {"type": "image_url", "image_url": {"url": <data: URL | path>}}  (OpenAI's spelling; also a bare string)
Paths are read from disk (relative ones from the working directory); there is no download.

`VisionProcessor.prepare(messages)` gives the same conversation with every image part replaced by its
placeholder text, `<|vision_start|>` + n x `<|image_pad|>` + `<|vision_end|>` (n = the tokens the tower
makes of that image at the pixel budget), plus the processed images in order. The placeholder is plain
text for the chat template, so any template renders it, tokenization stays increasing, and the token
ids hold one id per image token: what the engine samples from and the trainer trains on line up
position by position. Placeholder tokens are never actions (they are prompt or tool tokens).

Bad images never crash a run: `ImageError` names the image (the row's file and line, or the env reply)
and what is wrong (missing file, bytes that are not an image, more source pixels than
`max_source_pixels`, a decompression bomb's signature).
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from typing import Any

import torch

from train.models.vlm import VisionSpec
from train.utils.image_inputs import ImageInputs, digest_of

# Source images larger than this are refused before decoding (data.max_source_pixels): a 100-megapixel
# image would take ~300 MB decoded and seconds per turn, and is more often an error than an input.
DEFAULT_MAX_SOURCE_PIXELS = 40_000_000


class ImageError(ValueError):
    """An image part that cannot be used; the message names which and why."""


def image_source(part: Any) -> Any | None:
    """The image a content part holds (PIL image, path or data: URL), or None for a non-image part."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "image":
        for key in ("image", "path", "url"):
            if part.get(key) is not None:
                return part[key]
        raise ImageError("an image part has none of the keys 'image', 'path' or 'url'")
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ImageError("an image_url part needs image_url.url (a data: URL or a file path)")
        return url
    return None


def has_images(messages: list[dict]) -> bool:
    """Some message holds an image part."""
    return any(isinstance(m.get("content"), list) and any(image_source(p) is not None for p in m["content"])
               for m in messages)


def load_image(source: Any, max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS):
    """The RGB PIL image of `source` (a PIL image, a data: URL or a file path); ImageError otherwise."""
    from PIL import Image

    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, str) and source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            raise ImageError(f"a data: URL image must be base64 ('data:image/png;base64,...'), got {head[:40]!r}")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"a data: URL image is not valid base64 ({e})") from None
        image = _open(io.BytesIO(raw), "a data: URL image", max_source_pixels)
    elif isinstance(source, str):
        if source.startswith(("http://", "https://")):
            raise ImageError(f"image {source!r}: URLs are not downloaded; give a file path or a data: URL")
        if not os.path.isfile(source):
            raise ImageError(f"image file {source!r} does not exist")
        image = _open(source, f"image file {source!r}", max_source_pixels)
    else:
        raise ImageError(f"an image must be a PIL image, a file path or a data: URL, got {type(source).__name__}")
    w, h = image.size
    if w * h > max_source_pixels:
        raise ImageError(f"an image of {w}x{h} = {w * h:,} pixels is over data.max_source_pixels={max_source_pixels:,}")
    if w < 1 or h < 1:
        raise ImageError(f"an image of {w}x{h} pixels is empty")
    return image.convert("RGB")


def _open(fp: Any, what: str, max_source_pixels: int):
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # the size check below says it plainly, by the run's own limit
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(fp)
        w, h = image.size  # read from the header: a huge image is refused before its pixels are decoded
        if w * h > max_source_pixels:
            raise ImageError(f"{what} of {w}x{h} = {w * h:,} pixels is over data.max_source_pixels="
                             f"{max_source_pixels:,}")
        image.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{what} cannot be decoded as an image ({type(e).__name__}: {e})") from None
    return image


def loggable(messages: list[dict]) -> list[dict]:
    """The messages with each image part reduced to a short description (a path as it is; a data: URL or a
    PIL image as its kind and size), for trajectories.jsonl: a conversation's pictures would otherwise be
    written in full (or as a PIL object's repr). Messages without list content are the same objects."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(image_source(p) is not None for p in content
                                             if isinstance(p, dict) and p.get("type") in ("image", "image_url")):
            message = {**message, "content": [_described(p) for p in content]}
        out.append(message)
    return out


def _described(part: Any) -> Any:
    try:
        source = image_source(part)
    except ImageError:
        return part
    if source is None:
        return part
    if isinstance(source, str) and not source.startswith("data:"):
        return {"type": "image", "image": source}
    if isinstance(source, str):
        return {"type": "image", "image": f"<data: URL, {len(source)} characters>"}
    size = getattr(source, "size", None)
    return {"type": "image", "image": f"<{type(source).__name__} {size[0]}x{size[1]}>" if size else "<image>"}


def to_data_url(image, format: str = "PNG") -> str:
    """A PIL image as a base64 data: URL (what OpenAI-style image_url parts carry)."""
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return f"data:image/{format.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


class VisionProcessor:
    """Turns image parts into placeholder text and processed images, for one VLM (see the module docstring)."""

    def __init__(self, image_processor: Any, tokenizer: Any, spec: VisionSpec,
                 max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS) -> None:
        self.image_processor, self.spec = image_processor, spec
        self.max_source_pixels = int(max_source_pixels)
        names = tokenizer.convert_ids_to_tokens([spec.vision_start_id, spec.image_token_id, spec.vision_end_id])
        if any(n is None for n in names):
            raise ImageError("the tokenizer has no tokens for the model's vision ids "
                             f"(vision_start/image/vision_end = {spec.vision_start_id}/{spec.image_token_id}/"
                             f"{spec.vision_end_id}): use the VLM's own tokenizer")
        self.start, self.pad, self.end = names

    @classmethod
    def from_pretrained(cls, path: str, tokenizer: Any, config: Any, *, min_pixels: int | None = None,
                        max_pixels: int | None = None, max_source_pixels: int | None = None) -> "VisionProcessor":
        """The image processor saved with the model (preprocessor_config.json in `path`), with the pixel
        budget (`min_pixels`/`max_pixels`: images are resized to hold between these many pixels) from the
        run's config where given."""
        try:  # the PIL backend needs no torchvision (transformers 5.2x); older releases have one class for both
            from transformers import Qwen2VLImageProcessorPil as ImageProcessor
        except ImportError:
            from transformers import Qwen2VLImageProcessor as ImageProcessor

        if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            raise ImageError(f"'{path}' is a vision-language model without a preprocessor_config.json: save its "
                             "image processor there (processor.image_processor.save_pretrained(folder))")
        overrides = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        processor = ImageProcessor.from_pretrained(path, **overrides)
        return cls(processor, tokenizer, VisionSpec.from_config(config),
                   max_source_pixels if max_source_pixels is not None else DEFAULT_MAX_SOURCE_PIXELS)

    def process(self, source: Any) -> ImageInputs:
        image = load_image(source, self.max_source_pixels)
        out = self.image_processor(images=[image], return_tensors="pt")
        pixels = out["pixel_values"].to(torch.float32).contiguous()
        grid = out["image_grid_thw"][0].to(torch.long)
        return ImageInputs(pixels, grid, self.spec.tokens_of(grid), digest_of(pixels))

    def placeholder(self, image: ImageInputs) -> str:
        return self.start + self.pad * image.tokens + self.end

    def prepare(self, messages: list[dict], where: str = "a message") -> tuple[list[dict], list[ImageInputs]]:
        """(messages with image parts as placeholder text, and list content joined into one string; the
        processed images in order). Messages without list content are kept as they are."""
        out: list[dict] = []
        images: list[ImageInputs] = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, list):
                out.append(message)
                continue
            text = []
            for j, part in enumerate(content):
                try:
                    source = image_source(part)
                    if source is not None:
                        image = self.process(source)
                        images.append(image)
                        text.append(self.placeholder(image))
                    elif isinstance(part, dict) and part.get("type") == "text":
                        text.append(str(part.get("text", "")))
                    elif isinstance(part, str):
                        text.append(part)
                    else:
                        raise ImageError(f"a content part must be text or an image, got {part!r:.80}")
                except ImageError as e:
                    raise ImageError(f"{where}, message {i} ({message.get('role')}), part {j}: {e}") from None
            out.append({**message, "content": "".join(text)})
        return out, images


def refuse_images(messages: list[dict], where: str = "a message") -> tuple[list[dict], list]:
    """For a text-only model: (the messages as they are, no images); an image part is an ImageError naming it."""
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if image_source(part) is not None:
                raise ImageError(f"{where}, message {i} ({message.get('role')}), part {j} is an image, and the "
                                 "model is text-only: train a vision-language model (docs/vision.md)")
    return messages, []


def vision_processor(model_path: str, tokenizer: Any, data: Any) -> VisionProcessor | None:
    """The VisionProcessor of a vision-language model at `model_path` with the pixel budget of the `data.*`
    settings (min_pixels, max_pixels, max_source_pixels); None for a text model."""
    from transformers import AutoConfig

    from train.models.vlm import is_vision_config

    config = AutoConfig.from_pretrained(model_path)
    if not is_vision_config(config):
        return None
    return VisionProcessor.from_pretrained(model_path, tokenizer, config, min_pixels=data.min_pixels,
                                           max_pixels=data.max_pixels, max_source_pixels=data.max_source_pixels)
