"""The critic's model: a backbone and a value head (built for its layout by train/models/model_init.py)."""
from __future__ import annotations

import torch

from train.models.vlm import text_config


class ValueModel(torch.nn.Module):
    """The critic: the actor's architecture without its LM head, and a linear value head over the
    final hidden state. `model.model.layers` is where FSDP / AC find the decoder blocks, as for the actor."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.model = backbone
        self.config = backbone.config
        # a vision-language backbone's width is its language model's (train/models/vlm.py)
        self.value_head = torch.nn.Linear(text_config(backbone.config).hidden_size, 1)
        # A zero head: V = 0 at the start, the same on every rank and run (no RNG drawn).
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                            **kwargs).last_hidden_state
        # [b, L]: V of the state ending at each position (a copy, not a view: FSDP hooks the output)
        return self.value_head(hidden).squeeze(-1).clone()

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)
