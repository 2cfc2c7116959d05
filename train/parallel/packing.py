"""Packed micro-batches: sequences laid end to end in one row with no padding between them.

Each sequence restarts its position ids at 0 and attends only to itself: attention runs segment
by segment (`segments`, see train/parallel/seq_parallel.py), so a packed forward gives the same
numbers as running every sequence alone while token-wise work (MLP, norms, LM head) sees no
padding. The row is padded at the end to a multiple of sp * tp (a padding segment that attends to
itself and carries no loss) and split into `sp` equal chunks for Ulysses sequence parallelism.

Per-token tensors follow the trainer's convention (train/parallel/step_batch.py): for a sequence
of n tokens, entry t refers to token t + 1 (the label predicted at position t), so a sample has
n - 1 entries. `rows()` turns a flat per-position tensor back into the [samples, longest - 1]
layout the losses use; `gather()` stacks per-sample tensors into it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def plan_packs(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: indices grouped so each group's total length is <= max_tokens (a
    sequence longer than the budget gets a group of its own). Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for p, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                packs[p].append(i)
                loads[p] += lengths[i]
                break
        else:
            packs.append([i])
            loads.append(lengths[i])
    return [sorted(p) for p in packs]


def balance(lengths: list[int], n_bins: int) -> list[list[int]]:
    """Split indices over `n_bins` data-parallel groups with near-equal token totals (longest first,
    each to the lightest bin; ties to the lower bin). Deterministic: every rank computes the same."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(n_bins), key=lambda k: (loads[k], k))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


@dataclass
class PackedMicroBatch:
    index: list[int]  # samples in this pack (empty: a padding pack that keeps collectives in step)
    input_ids: torch.Tensor  # [1, C] this sp rank's chunk
    position_ids: torch.Tensor  # [1, C]
    segments: list[int]  # lengths of the row's segments in order (the end padding is one), summing to T
    segment_slots: tuple[torch.Tensor, torch.Tensor]  # see segment_slots(): built once, read by every layer
    labels: torch.Tensor  # [C] next token within the same sequence (0 where there is none)
    loss_positions: torch.Tensor  # [C] bool: the label is an action token of a real sample
    row_index: torch.Tensor  # [n, longest - 1] row positions (0..T-1) of each sample's entries (0 past its end)
    row_valid: torch.Tensor  # [n, longest - 1] float: 1 inside the sample
    action_mask: torch.Tensor  # [n, longest - 1] float
    cache: dict = field(default_factory=dict)  # per-pack tensors built once and reused across epochs

    @property
    def total_len(self) -> int:
        """T, the whole row's length (all sp chunks together)."""
        return sum(self.segments)

    def model_inputs(self) -> dict:
        """Keyword arguments for a forward of this rank's chunk (with the packed attention installed)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                "packed_segments": self.segment_slots}

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[T] per-position values -> [n, longest - 1] per-sample rows (zeros past each sample).
        index_select: its backward is an index_add, not a scatter with accumulation."""
        picked = flat.index_select(0, self.row_index.reshape(-1)).view(self.row_index.shape)
        return picked * self.row_valid.to(flat.dtype)

    def gather(self, per_sample: list[torch.Tensor], name: str | None = None) -> torch.Tensor:
        """This pack's per-sample [len-1] tensors stacked into [n, longest - 1] (zero padded) on the
        pack's device; cached under `name` when given (the same field is read every epoch)."""
        if name is not None and name in self.cache:
            return self.cache[name]
        out = torch.zeros(self.row_valid.shape, dtype=torch.float32)
        for row, i in enumerate(self.index):
            values = per_sample[i]
            out[row, : values.numel()] = values
        out = out.to(self.row_valid.device)
        if name is not None:
            self.cache[name] = out
        return out


def segment_slots(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For segment attention over a row made of segments of `lengths`: `slots` [segments, longest],
    the row position of each segment's j-th token (0 past its end, so every segment is left-aligned),
    and `real`, the flat indices of slots that hold a token, in row order."""
    longest = max(lengths)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    offsets = torch.arange(longest)
    valid = offsets[None, :] < torch.tensor(lengths)[:, None]
    slots = torch.where(valid, starts[:, None] + offsets[None, :], 0)
    return slots.to(device), valid.reshape(-1).nonzero().squeeze(1).to(device)


def build_packed(index: list[int], ids: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int,
                 device: torch.device, sp_rank: int = 0, sp_size: int = 1, multiple: int = 1) -> PackedMicroBatch:
    """Pack samples `index` (int64 token ids [len]; float action masks [len - 1], entry t for token
    t + 1) into one row of length T (a multiple of `multiple`, itself a multiple of sp_size) and keep
    this sp rank's chunk of it."""
    if index:
        seqs = [ids[i] for i in index]
        acts = [masks[i].float() for i in index]
    else:  # a padding pack: one sequence with no action token
        n = max(2, multiple)
        seqs, acts = [torch.full((n,), pad_id, dtype=torch.int64)], [torch.zeros(n - 1)]
    lengths = [int(s.numel()) for s in seqs]
    real = sum(lengths)
    total = -(-real // multiple) * multiple
    pad = total - real
    zero = torch.zeros(1, dtype=torch.int64)
    input_ids = torch.cat(seqs + [torch.full((pad,), pad_id, dtype=torch.int64)])
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])
    labels = torch.cat([t for s in seqs for t in (s[1:], zero)] + [torch.zeros(pad, dtype=torch.int64)])
    label_mask = torch.cat([t for a in acts for t in (a, torch.zeros(1))] + [torch.zeros(pad)])
    segments = lengths + ([pad] if pad else [])
    longest = max(lengths) - 1
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
    steps = torch.arange(longest)
    row_valid = (steps[None, :] < torch.tensor(lengths)[:, None] - 1).float()
    row_index = torch.where(row_valid > 0, offsets[:, None] + steps[None, :], 0)
    action = torch.nn.utils.rnn.pad_sequence(acts, batch_first=True) if longest else torch.zeros(len(acts), 0)
    chunk = total // sp_size
    lo, hi = sp_rank * chunk, (sp_rank + 1) * chunk
    return PackedMicroBatch(
        index=list(index), input_ids=input_ids[lo:hi].to(device)[None], position_ids=positions[lo:hi].to(device)[None],
        segments=segments, segment_slots=segment_slots(segments, device), labels=labels[lo:hi].to(device),
        loss_positions=label_mask[lo:hi].to(device) > 0, row_index=row_index.to(device),
        row_valid=row_valid.to(device), action_mask=action[:, :longest].to(device))
