"""Vision-language models (the Qwen2-VL / Qwen2.5-VL family): what the rest of the trainer needs to know
about a model with a vision tower.

- `text_config(config)`: the language model's settings (heads, layers, vocabulary) whatever the model; a
  VLM's top-level config holds a `text_config` and a `vision_config` instead.
- `model_class(config)`: the class to build (`AutoModelForImageTextToText` for a VLM).
- `VisionSpec`: the ids of the image placeholder and its delimiters, and the tower's merge factor.
- `mrope_positions`: Qwen2-VL's multimodal rotary positions of one sequence, [3, len] (temporal, height,
  width). Text tokens advance all three by one; an image's tokens take (t, row, column) offsets from the
  position where it starts, and the text after it continues past its largest offset. The engine and the
  trainer both lay out positions with this one function, so the sampler's and the trainer's log-probs are
  computed at the same positions (the model's own `get_rope_index` is the test's reference).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Model types whose vision tower, placeholder tokens and rotary positions this module knows.
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def is_vision_config(config: Any) -> bool:
    """The model has a vision tower (its config holds a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def text_config(config: Any) -> Any:
    """The language model's config: the config itself for a text model, its `text_config` for a VLM."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def vision_refusal(config: Any) -> str | None:
    """Why this VLM cannot train here, or None."""
    if is_vision_config(config) and getattr(config, "model_type", None) not in VISION_MODEL_TYPES:
        return (f"{type(config).__name__} (model_type={config.model_type!r}) is a vision-language model this trainer "
                f"does not know: its image tokens and rotary positions are laid out for {', '.join(VISION_MODEL_TYPES)}")
    return None


def model_class(config: Any) -> type:
    """The transformers auto class that builds `config` with its LM head."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The image encoder (`model.model.visual`, with its merger into the text width), or None."""
    inner = getattr(model, "model", None)
    return getattr(inner, "visual", None)


def language_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """A VLM's decoder blocks (`model.model.language_model.layers`), or None for a text model."""
    lm = getattr(getattr(model, "model", None), "language_model", None)
    layers = getattr(lm, "layers", None)
    return None if layers is None else list(layers)


@dataclass(frozen=True)
class VisionSpec:
    """Token ids around images and the tower's spatial merge (merge x merge patches make one token)."""
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    merge: int
    patch: int
    video_token_id: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> "VisionSpec":
        vision = config.vision_config
        video = getattr(config, "video_token_id", None)
        return cls(int(config.image_token_id), int(config.vision_start_token_id), int(config.vision_end_token_id),
                   int(vision.spatial_merge_size), int(vision.patch_size), None if video is None else int(video))

    @property
    def unsampled_ids(self) -> list[int]:
        """Tokens the policy never samples: a sampled placeholder would stand for an image that is not there
        (the model's forward counts placeholders against images). The engine and the trainer both give them
        probability 0 (train/algorithms/logits.py `mask_unsampled`), so sampler and trainer log-probs stay the same
        numbers."""
        ids = {self.image_token_id, self.vision_start_id, self.vision_end_id}
        if self.video_token_id is not None:
            ids.add(self.video_token_id)
        return sorted(ids)

    def tokens_of(self, grid: torch.Tensor) -> int:
        """Placeholder tokens of an image whose patch grid is (t, h, w)."""
        t, h, w = (int(x) for x in grid)
        return t * (h // self.merge) * (w // self.merge)




def image_spans(ids: torch.Tensor | list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each run of image placeholder tokens, in order: one run per image (runs are
    separated by the vision end and start tokens)."""
    ids = torch.as_tensor(ids)
    where = (ids == image_token_id).nonzero().squeeze(1).tolist()
    spans: list[tuple[int, int]] = []
    for i in where:
        if spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    return spans


def mrope_positions(ids: torch.Tensor | list[int], grids: torch.Tensor | None, spec: VisionSpec) -> torch.Tensor:
    """[3, len] int64 rotary positions of one sequence holding len(grids) images (see the module docstring)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    n = ids.numel()
    spans = image_spans(ids, spec.image_token_id)
    count = 0 if grids is None else int(grids.shape[0])
    if len(spans) != count:
        raise ValueError(f"mrope_positions: the sequence holds {len(spans)} images' placeholder runs but "
                         f"{count} image grids were given")
    out = torch.empty(3, n, dtype=torch.long)
    at, current = 0, 0
    for k, (start, end) in enumerate(spans):
        out[:, at:start] = torch.arange(current, current + start - at)
        current += start - at
        t, h, w = (int(x) for x in grids[k])
        h, w = h // spec.merge, w // spec.merge
        if end - start != t * h * w:
            raise ValueError(f"mrope_positions: image {k} has {end - start} placeholder tokens, its grid "
                             f"{tuple(int(x) for x in grids[k])} needs {t * h * w}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out[:, start:end] = torch.stack([tt, hh, ww]).reshape(3, -1) + current
        current += max(t, h, w)
        at = end
    out[:, at:] = torch.arange(current, current + n - at)
    return out
