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

Vision-language samples (`media`, see SampleMedia) bring their multimodal rotary positions ([3, len]
instead of 0, 1, 2, ...) and their images: a pack holds the pixels of the images whose placeholder runs
it lays out, in row order (the model scatters image features over placeholders in that order), and a
shared prompt's images once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from train.parallel.ring_attention import RingRow
from train.parallel.seq_parallel import gather_sequence, sequence_rows


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
    segment_slots: tuple[torch.Tensor, ...]  # see segment_slots() / shared_slots(): built once, read by every layer
    labels: torch.Tensor  # [C] next token within the same sequence (0 where there is none)
    loss_positions: torch.Tensor  # [C] bool: the label is an action token of a real sample
    row_index: torch.Tensor  # [n, longest - 1] row positions (0..T-1) of each sample's entries (0 past its end)
    row_valid: torch.Tensor  # [n, longest - 1] float: 1 inside the sample
    action_mask: torch.Tensor  # [n, longest - 1] float
    cache: dict = field(default_factory=dict)  # per-pack tensors built once and reused across epochs
    laid_out: int = 0  # tokens the row holds (no end padding): what a pass computes
    represented: int = 0  # tokens of its samples: what an unshared row would hold
    routes: torch.Tensor | None = None  # [C, layers, top_k] the sampler's experts per position (router replay)
    ring: int = 0  # ring attention over this many ranks: this rank's chunk is a zigzag piece (seq_parallel.sequence_rows)
    # Vision-language packs: the laid-out images' patches [patches, dim] and grids [images, 3], in row order
    # (position_ids is then [3, 1, C]: multimodal rotary positions).
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    # whether its forward keeps only the layers' inputs and recomputes in the backward (where the model has
    # activation checkpointing; Trainable marks each pack, from its length on the busiest rank)
    recompute: bool = True

    @property
    def total_len(self) -> int:
        """T, the whole row's length (all sp chunks together)."""
        return sum(self.segments)

    def model_inputs(self) -> dict:
        """Keyword arguments for a forward of this rank's chunk (with the packed attention installed)."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                  "packed_segments": self.segment_slots}
        if self.pixel_values is not None:
            inputs.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        return inputs

    def whole_row(self, chunk: torch.Tensor, group) -> torch.Tensor:
        """This rank's per-position values [C, ...] -> the whole row's [T, ...] in row order (differentiable)."""
        return gather_sequence(chunk, group, ring=self.ring)

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


@dataclass(frozen=True)
class SampleMedia:
    """A vision-language sample's multimodal rotary positions and images (train/models/vlm.py)."""
    positions: torch.Tensor  # int64 [3, len]
    images: tuple  # per image: .pixel_values [patches, dim], .grid [3] (train/datasets/vision.py ImageInputs)
    spans: tuple  # (start, end) of each image's placeholder run in the sample's ids


def _media_inputs(images: list, device: torch.device) -> dict:
    """PackedMicroBatch's pixel fields for `images` (in row order); none when there are no images."""
    if not images:
        return {}
    return {"pixel_values": torch.cat([im.pixel_values for im in images]).to(device),
            "image_grid_thw": torch.stack([im.grid for im in images]).to(device)}


def _images_in(media: SampleMedia, start: int, end: int) -> list:
    """The sample's images whose placeholder runs lie in its tokens [start, end); an image cut by the
    boundary is an error (shared prefixes end between images: see keyed_ids)."""
    out = []
    for image, (a, b) in zip(media.images, media.spans):
        if start <= a and b <= end:
            out.append(image)
        elif a < end and b > start:
            raise ValueError(f"packing: an image's placeholders [{a}, {b}) cross the laid-out run [{start}, {end})")
    return out


def keyed_ids(ids: torch.Tensor, media: SampleMedia | None) -> torch.Tensor:
    """The ids with each image's placeholder tokens replaced by a negative value derived from its pixels'
    digest: two samples' common prefix (shared prompts) then stops where their images differ, although
    every image's placeholder is the same token."""
    if media is None or not media.images:
        return ids
    out = ids.clone()
    for image, (a, b) in zip(media.images, media.spans):
        out[a:b] = -1 - (int(image.digest[:10], 16) if image.digest else id(image)) % (1 << 40)
    return out


def lay_routes(routing: list[torch.Tensor], index: list[int], row_index: torch.Tensor, total: int) -> torch.Tensor:
    """The row's routes [total, layers, top_k]: sample i's entry t (position t) at its row position,
    positions without one (each sample's last token, the end padding) at the dtype's maximum, which
    no expert index reaches (the router routes them itself; train/models/router_replay.py)."""
    first = routing[index[0]]
    out = torch.full((total, *first.shape[1:]), torch.iinfo(first.dtype).max, dtype=first.dtype)
    for row, i in enumerate(index):
        n = routing[i].shape[0]
        out[row_index[row, :n]] = routing[i]
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


@dataclass(frozen=True)
class Unit:
    """Samples packed together; with `shared` > 0 their first `shared` tokens are the same and are
    laid out once (a group's prompt), each sample's rest after them."""
    members: list[int]
    shared: int = 0


def common_prefix(seqs: list[torch.Tensor]) -> int:
    """Length of the longest token prefix all `seqs` share."""
    n = min(int(s.numel()) for s in seqs)
    if n == 0:
        return 0
    same = (torch.stack([s[:n] for s in seqs]) == seqs[0][:n]).all(0)
    differ = (~same).nonzero()
    return int(differ[0]) if differ.numel() else n


def shared_length(seqs: list[torch.Tensor]) -> int:
    """Tokens of `seqs` laid out once: their common prefix minus its last token, which every sample
    keeps at the start of its own part, so that the position predicting each sample's first own token
    is the sample's own (a single shared position could carry only one label)."""
    return max(0, min(common_prefix(seqs), min(int(s.numel()) for s in seqs)) - 1)


def unit_length(lengths: list[int], shared: int) -> int:
    return shared + sum(n - shared for n in lengths)


def prompt_units(index: list[int], ids: list[torch.Tensor], groups: list[int], max_tokens: int,
                 min_shared: int = 2) -> list[Unit]:
    """Samples `index` as units: the members of each group (`groups[i]`, in first-seen order) share
    their common prefix, split into consecutive units of at most `max_tokens` laid out; a sample
    alone, or a prefix under `min_shared` tokens, is a unit of one sample with nothing shared."""
    by_group: dict[int, list[int]] = {}
    for i in index:
        by_group.setdefault(groups[i], []).append(i)
    units: list[Unit] = []
    for members in by_group.values():
        chunk: list[int] = []
        for i in members:
            if chunk and unit_length([int(ids[j].numel()) for j in chunk + [i]],
                                     shared_length([ids[j] for j in chunk + [i]])) > max_tokens:
                units.append(_unit(chunk, ids, min_shared))
                chunk = []
            chunk.append(i)
        units.append(_unit(chunk, ids, min_shared))
    return [u for unit in units for u in ([unit] if unit.shared else [Unit([i]) for i in unit.members])]


def _unit(members: list[int], ids: list[torch.Tensor], min_shared: int) -> Unit:
    shared = shared_length([ids[i] for i in members]) if len(members) > 1 else 0
    return Unit(members, shared if shared >= min_shared else 0)


def shared_slots(whole: list[tuple[int, int]], tails: list[tuple[int, int, int]], positions: int,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
    """Attention segments of a row with shared prompts (see `_segment_attention`): `whole` are
    (start, length) runs attended causally on their own (lone samples, prompts, the end padding);
    `tails` are (prompt start, prompt length, own start): a sample's own tokens, each querying its
    prompt's keys and its own up to itself (the own part runs to the next run's start). Returns
    (slots, real, tail queries, tail keys, prompt lengths); `real` maps each of the row's `positions`
    to its output slot, whole segments' slots first."""
    starts = sorted([w[0] for w in whole] + [t[2] for t in tails]) + [positions]
    end_of = {start: starts[i + 1] for i, start in enumerate(starts[:-1])}
    longest = max(n for _, n in whole)
    slots = torch.zeros(len(whole), longest, dtype=torch.int64)
    owner = torch.empty(positions, dtype=torch.int64)
    for k, (start, n) in enumerate(whole):
        slots[k, :n] = torch.arange(start, start + n)
        owner[start:start + n] = k * longest + torch.arange(n)
    own = [end_of[own_start] - own_start for _, _, own_start in tails]
    width_q = max(own)
    width_k = max(p + n for (_, p, _), n in zip(tails, own))
    queries = torch.zeros(len(tails), width_q, dtype=torch.int64)
    keys = torch.zeros(len(tails), width_k, dtype=torch.int64)
    base = len(whole) * longest
    for k, ((p_start, p_len, own_start), n) in enumerate(zip(tails, own)):
        queries[k, :n] = torch.arange(own_start, own_start + n)
        keys[k, :p_len + n] = torch.cat([torch.arange(p_start, p_start + p_len), torch.arange(own_start, own_start + n)])
        owner[own_start:own_start + n] = base + k * width_q + torch.arange(n)
    prefix = torch.tensor([p for _, p, _ in tails], dtype=torch.int64)
    return tuple(t.to(device) for t in (slots, owner, queries, keys, prefix))


def _ring_row(segments: list[int], positions: torch.Tensor, tails: list[tuple[int, int, int]],
              device: torch.device) -> RingRow:
    """The row's segment, position and prompt segment of every position, for ring attention (see RingRow)."""
    seg = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments))
    prefix = torch.full_like(seg, -1)
    for prompt_start, _, own_start in tails:  # a sample's own part continues its shared prompt's segment
        own = int(seg[own_start])
        prefix[own_start:own_start + segments[own]] = seg[prompt_start]
    return RingRow(seg.to(device), positions.to(device), prefix.to(device))


def build_packed(index: list[int], ids: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int,
                 device: torch.device, sp_rank: int = 0, sp_size: int = 1, multiple: int = 1,
                 units: list[Unit] | None = None, routing: list[torch.Tensor] | None = None,
                 ring: int = 0, media: list[SampleMedia] | None = None,
                 blank: tuple[int, Any] | None = None) -> PackedMicroBatch:
    """Pack samples `index` (int64 token ids [len]; float action masks [len - 1], entry t for token
    t + 1) into one row of length T (a multiple of `multiple`, itself a multiple of sp_size) and keep
    this sp rank's chunk of it. With `units` (covering `index`, in its order), a unit's shared prefix
    is laid out once: see `prompt_units` and `shared_slots`. With `routing` (per sample [len - 1,
    layers, top_k]), the pack's `routes` hold them at their row positions (`lay_routes`). With a `ring` of
    cp ranks (context parallelism; sp_size = cp x Ulysses' sp, `multiple` a multiple of 2 x sp_size) the rank
    keeps its piece of its ring rank's zigzag chunks and the row's segments are a RingRow. With `media` (per
    sample, vision-language), positions are the samples' multimodal ones and the pack carries their images.
    `blank` = (image token id, a blank image of one token): a vision-language pack that would hold no image gets
    this one in a segment of its own (no loss, attended by nothing else), so that every rank's forward runs the
    vision tower: FSDP gathers the tower's shards in every rank's forward, or the ranks' collectives part ways."""
    if units is not None and any(u.shared for u in units):
        return _build_shared(units, ids, masks, pad_id, device, sp_rank, sp_size, multiple, routing, ring, media,
                             blank)
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
    images = []
    if media is not None or blank is not None:
        positions = torch.cat([media[i].positions for i in index] + [torch.arange(pad).expand(3, -1)], dim=1) \
            if index and media is not None else positions.expand(3, -1)
        images = [im for i in index for im in media[i].images] if media is not None else []
    if blank is not None and not images:  # the tower runs on every rank (see the docstring)
        if sp_size > 1 or ring:
            raise ValueError("packing: a blank image needs the whole row on one rank (sp_size=1, no ring)")
        input_ids, labels = torch.cat([input_ids, torch.tensor([blank[0]])]), torch.cat([labels, zero])
        label_mask, positions = torch.cat([label_mask, torch.zeros(1)]), torch.cat([positions, zero.expand(3, 1)], 1)
        segments, total, images = segments + [1], total + 1, [blank[1]]
    mine = sequence_rows(sp_rank, sp_size, ring, total)  # this rank's positions
    pixels = _media_inputs(images, device)
    return PackedMicroBatch(
        index=list(index), input_ids=input_ids[mine].to(device)[None],
        position_ids=positions[..., mine].to(device).unsqueeze(-2),
        segments=segments, segment_slots=_ring_row(segments, positions, [], device) if ring else segment_slots(
            segments, device), labels=labels[mine].to(device),
        loss_positions=label_mask[mine].to(device) > 0, row_index=row_index.to(device),
        row_valid=row_valid.to(device), action_mask=action[:, :longest].to(device),
        laid_out=real if index else 0, represented=real if index else 0,
        routes=lay_routes(routing, index, row_index, total)[mine].to(device) if routing and index else None,
        ring=ring, **pixels)


def _build_shared(units: list[Unit], ids: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int,
                  device: torch.device, sp_rank: int, sp_size: int, multiple: int,
                  routing: list[torch.Tensor] | None = None, ring: int = 0,
                  media: list[SampleMedia] | None = None, blank: tuple[int, Any] | None = None) -> PackedMicroBatch:
    """`build_packed` with shared prefixes. A unit sharing s tokens is laid out as its prefix (positions
    0..s-1, labels the next prefix token), then each member's tokens from s on (positions continuing
    from s). Sample i's entry t sits at the prefix's row position t for t < s, else in its own part.
    Built in Python lists and turned into tensors once (per-sample small tensor ops cost more)."""
    tokens: list[int] = []
    positions: list[int] = []
    labels: list[int] = []
    label_mask: list[float] = []
    segments: list[int] = []
    whole: list[tuple[int, int]] = []  # (start, length): attended on their own
    tails: list[tuple[int, int, int]] = []  # (prompt start, prompt length, own start)
    entries: list[list[int]] = []  # per sample: the row position of each of its len - 1 entries
    index: list[int] = []
    runs3: list[torch.Tensor] = []  # vision-language: each run's multimodal positions [3, run]
    images: list = []  # ... and the images laid out, in row order

    def lay(run: list[int], first_position: int, next_labels: list[int], acts: list[float]) -> int:
        """Append a run to the row; its start."""
        start = len(tokens)
        tokens.extend(run)
        positions.extend(range(first_position, first_position + len(run)))
        labels.extend(next_labels)
        label_mask.extend(acts)
        segments.append(len(run))
        return start

    def lay_media(i: int, start: int, end: int) -> None:
        """Sample i's tokens [start, end) were laid out as a run: its positions and images there."""
        if media is not None:
            runs3.append(media[i].positions[:, start:end])
            images.extend(_images_in(media[i], start, end))

    for unit in units:
        s = unit.shared
        if s == 0:
            for i in unit.members:
                seq = ids[i].tolist()
                start = lay(seq, 0, seq[1:] + [0], masks[i].float().tolist() + [0.0])
                lay_media(i, 0, len(seq))
                whole.append((start, len(seq)))
                entries.append(list(range(start, start + len(seq) - 1)))
                index.append(i)
            continue
        first = ids[unit.members[0]].tolist()
        # the prefix: labels are the next prefix token (the same for every member), an action where
        # any member's is (the prefix may reach into identical first response tokens)
        prefix_acts = torch.stack([masks[i][:s].float() for i in unit.members]).amax(0).tolist()
        prefix_start = lay(first[:s], 0, first[1:s + 1], prefix_acts)
        lay_media(unit.members[0], 0, s)
        whole.append((prefix_start, s))
        for i in unit.members:
            seq = ids[i].tolist()
            start = lay(seq[s:], s, seq[s + 1:] + [0], masks[i][s:].float().tolist() + [0.0])
            lay_media(i, s, len(seq))
            tails.append((prefix_start, s, start))
            entries.append(list(range(prefix_start, prefix_start + s)) + list(range(start, start + len(seq) - 1 - s)))
            index.append(i)
    blanks = 0
    if blank is not None and not images:  # the tower runs on every rank (build_packed's docstring)
        if sp_size > 1 or ring:
            raise ValueError("packing: a blank image needs the whole row on one rank (sp_size=1, no ring)")
        whole.append((lay([blank[0]], 0, [0], [0.0]), 1))
        runs3.append(torch.zeros(3, 1, dtype=torch.int64))
        images.append(blank[1])
        blanks = 1
    at = len(tokens)
    total = -(-at // multiple) * multiple
    pad = total - at
    if pad:
        whole.append((lay([pad_id] * pad, 0, [0] * pad, [0.0] * pad), pad))
        runs3.append(torch.arange(pad).expand(3, -1))
    input_ids, position_ids = torch.tensor(tokens, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)
    text_positions = position_ids
    if media is not None:
        position_ids = torch.cat(runs3, dim=1)
    label_ids, loss = torch.tensor(labels, dtype=torch.int64), torch.tensor(label_mask, dtype=torch.float32)
    longest = max(len(e) for e in entries)
    row_valid = torch.tensor([[1.0] * len(e) + [0.0] * (longest - len(e)) for e in entries])
    row_index = torch.tensor([e + [0] * (longest - len(e)) for e in entries], dtype=torch.int64)
    action = torch.nn.utils.rnn.pad_sequence([masks[i].float() for i in index], batch_first=True)
    mine = sequence_rows(sp_rank, sp_size, ring, total)  # this rank's positions
    return PackedMicroBatch(
        index=index, input_ids=input_ids[mine].to(device)[None],
        position_ids=position_ids[..., mine].to(device).unsqueeze(-2),
        segments=segments, segment_slots=_ring_row(segments, text_positions, tails, device) if ring else shared_slots(
            whole, tails, total, device),
        labels=label_ids[mine].to(device), loss_positions=loss[mine].to(device) > 0, row_index=row_index.to(device),
        row_valid=row_valid.to(device), action_mask=action[:, :longest].to(device),
        laid_out=at - pad - blanks, represented=sum(int(ids[i].numel()) for i in index),
        routes=lay_routes(routing, index, row_index, total)[mine].to(device) if routing else None, ring=ring,
        **_media_inputs(images, device))
