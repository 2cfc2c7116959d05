"""The step batch: a step's kept samples, dispatched once to the data-parallel groups that process them.

Every rank rolls out its own prompts. Before any model pass the samples move, once, to the ranks
that will run them: a sample goes only to the sp x tp ranks of its dp group (an all-to-all), never
to every rank. Every per-token tensor is built here, once, in the trainer's convention: entry t of a
[len - 1] tensor refers to token t + 1 (the label predicted at position t). This is the one place
the shift happens. Reference log-probs, old log-probs, values, advantages and returns are then
written into the batch in place (`fields`), and both updates read them from it; nothing goes back
to the samples' owners but metrics.

Which samples a dp group holds is decided from an index every rank shares (one all-gather of each
sample's length, group and reward): mini-batch m takes the samples whose global number is m mod
`mini_batches`, and each mini-batch is balanced over the dp groups by token count (longest first,
to the lightest group). Every rank computes the same assignment without asking. Mini-batch
membership depends only on the global order, not on the layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from train.parallel.collectives import all_gather_flat
from train.parallel.layout import Layout
from train.parallel.packing import balance
from train.utils.image_inputs import ImageInputs, digest_of


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class BatchIndex:
    """Every kept sample of the step on every rank, identical everywhere; global sample g is the
    `local[g]`-th kept sample of rank `owner[g]`, in rank order."""
    owner: list[int]
    local: list[int]
    length: list[int]
    group: list[int]  # global group id (samples of a group are contiguous on their owner)
    reward: list[float]  # the (shaped) reward the advantages start from
    n_groups: int
    route: list[int]  # which distillation teacher scores the sample (distill.teachers by source); -1: none

    @property
    def size(self) -> int:
        return len(self.owner)


def exchange_index(lengths: list[int], groups: list[int], rewards: list[float], device: torch.device,
                   routes: list[int] | None = None) -> BatchIndex:
    """All ranks' per-sample metadata (two small all-gathers: counts, then the padded rows); `routes`: each
    sample's distillation teacher (default 0: the one teacher, if any)."""
    rank, world = _world()
    routes = [0] * len(lengths) if routes is None else list(routes)
    if world == 1:
        n_groups = max(groups, default=-1) + 1
        return BatchIndex([0] * len(lengths), list(range(len(lengths))), list(lengths), list(groups),
                          [float(r) for r in rewards], n_groups, routes)
    count = torch.tensor([len(lengths)], dtype=torch.int64, device=device)
    counts = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_flat(counts, count)
    counts_l = counts.tolist()
    width = max(max(counts_l), 1)
    rows = torch.zeros(width, 4, dtype=torch.float64, device=device)
    if lengths:
        rows[: len(lengths)] = torch.tensor(list(zip(lengths, groups, rewards, routes)), dtype=torch.float64)
    everything = torch.empty(world * width * 4, dtype=torch.float64, device=device)
    all_gather_flat(everything, rows.reshape(-1))
    everything = everything.cpu().view(world, width, 4)
    owner, local, length, group, reward, route = [], [], [], [], [], []
    offset = 0
    for r, n in enumerate(counts_l):
        part = everything[r, :n]
        n_local_groups = int(part[:, 1].max()) + 1 if n else 0
        owner += [r] * n
        local += list(range(n))
        length += part[:, 0].long().tolist()
        group += (part[:, 1].long() + offset).tolist()
        reward += part[:, 2].tolist()
        route += part[:, 3].long().tolist()
        offset += n_local_groups
    return BatchIndex(owner, local, length, group, reward, offset, route)


def assign(index: BatchIndex, dp: int, mini_batches: int, by_group: bool = False) -> tuple[list[int], list[int]]:
    """(dp group, mini-batch) of every global sample; deterministic, the same on every rank. With
    `by_group` (shared-prompt packing) a group's samples of a mini-batch stay in one dp group, so
    their prompt can be laid out once, unless the mini-batch has fewer groups than dp groups."""
    minibatch = [g % mini_batches for g in range(index.size)]
    target = [0] * index.size
    for m in range(mini_batches):
        members = [g for g in range(index.size) if minibatch[g] == m]
        units: dict[int, list[int]] = {}
        for g in members:
            units.setdefault(index.group[g], []).append(g)
        if by_group and len(units) >= dp:
            parts = list(units.values())
            for d, bin_ in enumerate(balance([sum(index.length[g] for g in part) for part in parts], dp)):
                for j in bin_:
                    for g in parts[j]:
                        target[g] = d
            continue
        for d, part in enumerate(balance([index.length[g] for g in members], dp)):
            for j in part:
                target[members[j]] = d
    return target, minibatch


@dataclass
class StepBatch:
    """The samples one dp group holds (the same on its sp x tp ranks), in (mini-batch, global) order."""
    index: BatchIndex
    dp: int  # the number of dp groups of this layout
    dp_rank: int
    group_size: int  # sp x tp: ranks that hold the same samples
    is_leader: bool  # counts this group's samples in global sums (one rank per dp group)
    mini_batches: int  # the mini-batch count the assignment balanced (any count can be trained)
    members: list[int]  # global sample numbers held here
    ids: list[torch.Tensor]  # int64 [len]
    mask: list[torch.Tensor]  # float32 [len - 1]: 1 where token t + 1 is an action token
    sampler_logp: list[torch.Tensor]  # float32 [len - 1]: the engine's log-prob of token t + 1
    fields: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # per token [len - 1], added by passes
    share_prompt: bool = False  # a group's common prefix is laid out once per pack (actor.share_prompt)
    # The sampler's expert choices per position, [len - 1, layers, top_k] (actor.router_replay); None: off
    routing: list[torch.Tensor] | None = None
    # A vision-language policy's images per sample, in placeholder order (train/datasets/vision.py); None: text
    images: list[list] | None = None
    media: list | None = None  # per sample packing.SampleMedia, built from ids and images by the first pass

    def __len__(self) -> int:
        return len(self.members)

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor([self.index.reward[g] for g in self.members], dtype=torch.float64)

    @property
    def groups(self) -> torch.Tensor:
        return torch.tensor([self.index.group[g] for g in self.members], dtype=torch.int64)

    def minibatch_members(self, m: int, count: int) -> list[int]:
        """Local positions of the samples of mini-batch m of `count`: global sample g is in mini-batch
        g mod count, whatever the layout."""
        return [i for i, g in enumerate(self.members) if g % count == m]

    def layout_key(self) -> tuple[int, int]:
        return self.dp, self.group_size


def _ranks_of(dp_index: int, group_size: int) -> range:
    """Global ranks of a dp group: ranks are laid out (dp, sp, tp) with tp innermost."""
    return range(dp_index * group_size, (dp_index + 1) * group_size)


def _all_to_all(send: list[list[torch.Tensor]], recv_sizes: list[int], dtype: torch.dtype,
                device: torch.device) -> list[torch.Tensor]:
    """send[r]: tensors for rank r -> one flat tensor received from each rank (its parts concatenated)."""
    rank, world = _world()
    flat_parts = [torch.cat([t.reshape(-1).to(dtype) for t in parts]) if parts else torch.empty(0, dtype=dtype)
                  for parts in send]
    if world == 1:
        return [flat_parts[0]]
    in_sizes = [p.numel() for p in flat_parts]
    inp = torch.cat(flat_parts).to(device)
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(out, inp, output_split_sizes=recv_sizes, input_split_sizes=in_sizes)
    return list(torch.split(out.cpu(), recv_sizes))


def dispatch(index: BatchIndex, ids: list[list[int]], masks: list[list[int]], sampler_logp: list[list[float]],
             layout: Layout, mini_batches: int, device: torch.device, share_prompt: bool = False,
             routing: list[torch.Tensor] | None = None, route_shape: tuple[int, int] = (0, 0),
             route_dtype: torch.dtype = torch.uint8, images: list[list] | None = None,
             lags: list[list[float]] | None = None) -> StepBatch:
    """This rank's kept samples (ids, action masks, sampler log-probs: one entry per token) -> the
    StepBatch of its dp group in `layout`. Two all-to-alls (token ids with masks, log-probs); every
    rank takes part. With `routing` (per sample [len - 1, *route_shape] of `route_dtype`, every rank
    passing it), a third carries the sampler's expert choices; with `images` (per sample, a vision-language
    policy, every rank passing them), `send_images` carries each sample's pixels to the ranks that train it. With
    `lags` (per token: how many weight versions older than the trainer's the sampler was, -1 where nothing was
    sampled; every rank passing them) they travel with the log-probs, into `fields["sampler_lag"]`."""
    rank, world = _world()
    dp, dp_rank = layout.sizes.dp, layout.dp_rank
    group_size, is_leader = layout.sizes.seq * layout.sizes.tp, layout.is_data_leader
    target, minibatch = assign(index, dp, mini_batches, by_group=share_prompt)
    mine = sorted((g for g in range(index.size) if target[g] == dp_rank), key=lambda g: (minibatch[g], g))
    own = [g for g in range(index.size) if index.owner[g] == rank]  # in local order
    send_int: list[list[torch.Tensor]] = [[] for _ in range(world)]
    send_float: list[list[torch.Tensor]] = [[] for _ in range(world)]
    send_route: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for g in own:
        j = index.local[g]
        tokens = torch.tensor([ids[j], masks[j]], dtype=torch.int64)
        logp = torch.tensor(sampler_logp[j], dtype=torch.float32)
        if lags is not None:
            logp = torch.cat([logp, torch.tensor(lags[j], dtype=torch.float32)])
        for r in _ranks_of(target[g], group_size):
            send_int[r].append(tokens)
            send_float[r].append(logp)
            if routing is not None:
                send_route[r].append(routing[j])
    # What arrives from rank r: its samples for my group, in its local order (sizes known from the index).
    from_rank = [[g for g in range(index.size) if index.owner[g] == r and target[g] == dp_rank] for r in range(world)]
    got_int = _all_to_all(send_int, [2 * sum(index.length[g] for g in gs) for gs in from_rank], torch.int64, device)
    floats = 1 if lags is None else 2  # per token: the log-prob (and the lag)
    got_float = _all_to_all(send_float, [floats * sum(index.length[g] for g in gs) for gs in from_rank],
                            torch.float32, device)
    by_global: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for gs, flat_i, flat_f in zip(from_rank, got_int, got_float):
        lens = [index.length[g] for g in gs]
        for g, tok, lp in zip(gs, torch.split(flat_i, [2 * n for n in lens]),
                              torch.split(flat_f, [floats * n for n in lens])):
            by_global[g] = (tok.view(2, -1), lp.view(floats, -1))
    batch_ids, batch_mask, batch_logp, batch_lag = [], [], [], []
    for g in mine:
        tok, lp = by_global[g]
        batch_ids.append(tok[0].clone())
        batch_mask.append(tok[1, 1:].float())  # the shift: entry t is token t + 1
        batch_logp.append(lp[0, 1:].clone())
        if lags is not None:
            batch_lag.append(lp[1, 1:].clone())
    batch_routing = None
    if routing is not None:
        width = route_shape[0] * route_shape[1]
        sizes = [[(index.length[g] - 1) * width for g in gs] for gs in from_rank]
        got_route = _all_to_all(send_route, [sum(s) for s in sizes], route_dtype, device)
        routes = {g: part.view(-1, *route_shape) for gs, flat, s in zip(from_rank, got_route, sizes)
                  for g, part in zip(gs, torch.split(flat, s))}
        batch_routing = [routes[g].clone() for g in mine]
    batch_images = None
    if images is not None:
        sent = send_images({g: images[index.local[g]] for g in own}, {g: list(_ranks_of(target[g], group_size))
                                                                       for g in own}, from_rank, device)
        batch_images = [sent[g] for g in mine]
    return StepBatch(index, dp, dp_rank, group_size, is_leader, mini_batches, mine, batch_ids, batch_mask,
                     batch_logp, share_prompt=share_prompt, routing=batch_routing, images=batch_images,
                     fields={"sampler_lag": batch_lag} if lags is not None else {})


def send_images(images: dict[int, list], targets: dict[int, list[int]], from_rank: list[list[int]],
                device: torch.device) -> dict[int, list]:
    """Each of this rank's samples' images (global sample -> ImageInputs list) to the ranks `targets` names;
    the images of the samples `from_rank[r]` lists, from each rank r, in that order. Three all-to-alls: the
    sizes, then per image (tokens, t, h, w) and the patches; each sample travels only to its ranks."""
    rank, world = _world()
    send_int: list[list[torch.Tensor]] = [[] for _ in range(world)]
    send_float: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for g, ims in images.items():
        head = torch.tensor([len(ims)] + [x for im in ims for x in (im.tokens, *im.grid.tolist(), im.pixel_values.shape[1])],
                            dtype=torch.int64)
        for r in targets[g]:
            send_int[r].append(head)
            send_float[r] += [im.pixel_values for im in ims]
    sizes = torch.tensor([[sum(t.numel() for t in send_int[r]), sum(t.numel() for t in send_float[r])]
                          for r in range(world)], dtype=torch.int64)
    if world > 1:
        got_sizes = torch.empty_like(sizes).to(device)
        dist.all_to_all_single(got_sizes, sizes.to(device))
        got_sizes = got_sizes.cpu()
    else:
        got_sizes = sizes
    ints = _all_to_all(send_int, got_sizes[:, 0].tolist(), torch.int64, device)
    floats = _all_to_all(send_float, got_sizes[:, 1].tolist(), torch.float32, device)
    out: dict[int, list] = {}
    for gs, flat_i, flat_f in zip(from_rank, ints, floats):
        at_i = at_f = 0
        for g in gs:
            count, at_i = int(flat_i[at_i]), at_i + 1
            ims = []
            for _ in range(count):
                tokens, t, h, w, dim = flat_i[at_i:at_i + 5].tolist()
                at_i += 5
                pixels = flat_f[at_f:at_f + t * h * w * dim].view(t * h * w, dim).clone()
                at_f += t * h * w * dim
                ims.append(ImageInputs(pixels, torch.tensor([t, h, w]), tokens, digest_of(pixels)))
            out[g] = ims
    return out


def transfer(src: StepBatch, dst: StepBatch, names: list[str], device: torch.device) -> None:
    """Copy per-token fields from one layout's batch to another's (same index): each src dp group's
    leader sends each sample to the ranks of its dst group. A no-op when both are the same batch."""
    if src is dst:
        return
    rank, world = _world()
    src_groups, dst_groups = _members_by_group(src), _members_by_group(dst)
    dst_group_of = {g: d for d, gs in enumerate(dst_groups) for g in gs}
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    if src.is_leader:
        for i, g in enumerate(src.members):
            for r in _ranks_of(dst_group_of[g], dst.group_size):
                send[r] += [src.fields[name][i] for name in names]
    wanted = set(dst.members)
    from_rank: list[list[int]] = [[] for _ in range(world)]
    for d, gs in enumerate(src_groups):  # what group d's leader sends me, in its order
        from_rank[d * src.group_size] = [g for g in gs if g in wanted]
    per_sample = {g: len(names) * (src.index.length[g] - 1) for g in dst.members}
    got = _all_to_all(send, [sum(per_sample[g] for g in gs) for gs in from_rank], torch.float32, device)
    values: dict[int, list[torch.Tensor]] = {}
    for gs, flat in zip(from_rank, got):
        for g, part in zip(gs, torch.split(flat, [per_sample[g] for g in gs])):
            values[g] = list(part.view(len(names), -1))
    for k, name in enumerate(names):
        dst.fields[name] = [values[g][k].clone() for g in dst.members]


def _members_by_group(batch: StepBatch) -> list[list[int]]:
    target, minibatch = assign(batch.index, batch.dp, batch.mini_batches, by_group=batch.share_prompt)
    out: list[list[int]] = [[] for _ in range(batch.dp)]
    for g in sorted(range(batch.index.size), key=lambda g: (minibatch[g], g)):
        out[target[g]].append(g)
    return out
