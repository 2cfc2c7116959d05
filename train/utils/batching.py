"""Turning ragged token sequences into padded micro-batches under a token budget.

Sequences are right-padded; position t of the per-token tensors refers to token t+1 (the label
predicted from position t), so every per-token tensor has length len(ids) - 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy groups of sample indices, longest first, with rows * longest <= max_tokens
    (a single over-long sequence still gets its own micro-batch)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


@dataclass
class MicroBatch:
    index: list[int]  # sample indices in this micro-batch (empty for a padding micro-batch)
    input_ids: torch.Tensor  # [b, L]
    attention_mask: torch.Tensor  # [b, L]
    labels: torch.Tensor  # [b, L-1]
    action_mask: torch.Tensor  # [b, L-1] float

    def pad_token_tensor(self, per_sample: list[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """Stack per-sample [len-1] tensors of this micro-batch into [b, L-1]."""
        out = torch.full(self.labels.shape, fill, dtype=torch.float32)
        for row, i in enumerate(self.index):
            values = per_sample[i]
            out[row, : values.numel()] = values
        return out


def build_micro_batch(index: list[int], seqs: list[list[int]], masks: list[list[int]], pad_id: int,
                      device: torch.device) -> MicroBatch:
    if not index:  # a padding micro-batch keeps FSDP's collectives in step across ranks
        ids = torch.full((1, 2), pad_id, dtype=torch.long)
        attn = torch.ones_like(ids)
        return MicroBatch([], ids.to(device), attn.to(device), ids[:, 1:].to(device),
                          torch.zeros(1, 1, device=device))
    longest = max(len(seqs[i]) for i in index)
    ids = torch.full((len(index), longest), pad_id, dtype=torch.long)
    attn = torch.zeros((len(index), longest), dtype=torch.long)
    act = torch.zeros((len(index), longest), dtype=torch.float32)
    for row, i in enumerate(index):
        n = len(seqs[i])
        ids[row, :n] = torch.tensor(seqs[i])
        attn[row, :n] = 1
        act[row, :n] = torch.tensor(masks[i], dtype=torch.float32)
    return MicroBatch(index, ids.to(device), attn.to(device), ids[:, 1:].to(device), act[:, 1:].to(device))
