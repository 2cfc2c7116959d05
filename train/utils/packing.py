"""Packed micro-batches: sequences laid end to end in one row with no padding between them.

Each sequence restarts its position ids at 0 and attends only to itself: attention runs segment
by segment (`segments`, see train/utils/seq_parallel.py), so a packed forward gives the same numbers
as running every sequence alone while token-wise work (MLP, norms, LM head) sees no padding. The
row is padded at the end to a multiple of sp * tp (a padding segment that attends to itself and
carries no loss) and split into `sp` equal chunks for Ulysses sequence parallelism.

Per-token tensors follow the trainer's convention: for a sequence of n tokens, entry t refers to
token t + 1 (the label predicted at position t), so a sample has n - 1 entries. `rows()` turns a
flat per-position tensor back into the familiar [samples, longest - 1] layout for the losses.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    def pad_token_tensor(self, per_sample: list[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """Stack this pack's per-sample [len-1] tensors into [n, longest - 1]."""
        out = torch.full(self.row_valid.shape, fill, dtype=torch.float32)
        for row, i in enumerate(self.index):
            values = per_sample[i]
            out[row, : values.numel()] = values
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


def build_packed(index: list[int], seqs: list[list[int]], masks: list[list[int]], pad_id: int,
                 device: torch.device, sp_rank: int = 0, sp_size: int = 1, multiple: int = 1) -> PackedMicroBatch:
    """Pack samples `index` into one row of length T (a multiple of `multiple`, itself a multiple of
    sp_size) and keep this sp rank's chunk of it."""
    members = [(seqs[i], masks[i]) for i in index]
    if not members:  # a padding pack: one sequence with no action token
        members = [([pad_id] * max(2, multiple), [0] * max(2, multiple))]
    ids, pos, labels, label_mask = [], [], [], []
    offsets = []
    for seq, mask in members:
        offsets.append(len(ids))
        n = len(seq)
        ids += seq
        pos += range(n)
        labels += seq[1:] + [0]
        label_mask += [float(m) for m in mask[1:]] + [0.0]
    real = len(ids)
    total = -(-real // multiple) * multiple
    pad = total - real
    ids += [pad_id] * pad
    pos += range(pad)
    labels += [0] * pad
    label_mask += [0.0] * pad
    segments = [len(seq) for seq, _ in members] + ([pad] if pad else [])
    longest = max(len(seq) for seq, _ in members)
    n_rows = len(members)
    row_valid = torch.zeros(n_rows, longest - 1)
    action = torch.zeros(n_rows, longest - 1)
    row_index = torch.zeros(n_rows, longest - 1, dtype=torch.long)
    for r, ((seq, mask), off) in enumerate(zip(members, offsets)):
        k = len(seq) - 1
        row_index[r, :k] = torch.arange(off, off + k)
        row_valid[r, :k] = 1.0
        action[r, :k] = torch.tensor(mask[1:], dtype=torch.float32)
    chunk = total // sp_size
    lo, hi = sp_rank * chunk, (sp_rank + 1) * chunk
    as_t = lambda x, dtype=torch.long: torch.tensor(x[lo:hi], dtype=dtype, device=device)  # noqa: E731
    return PackedMicroBatch(
        index=list(index), input_ids=as_t(ids)[None], position_ids=as_t(pos)[None],
        segments=segments, segment_slots=segment_slots(segments, device), labels=as_t(labels), loss_positions=as_t(label_mask, torch.float32) > 0,
        row_index=row_index.to(device), row_valid=row_valid.to(device), action_mask=action.to(device))
