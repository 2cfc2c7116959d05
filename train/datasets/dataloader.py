"""An endless, resumable stream of prompt batches, split over data-parallel ranks.

Every rank walks the same global sequence: epoch e is a permutation of the rows seeded by
``seed + e`` (the order PyTorch's ``DistributedSampler`` uses), epochs follow each other without a
gap, and step k takes the next ``batch_size * world_size`` rows of that stream; rank r keeps every
world_size-th of them, starting at r. Every batch is full (the stream runs into the next epoch),
every rank has the same number of rows, and fewer rows than ranks simply repeat.

A weighted mixture (`shares`, train/datasets/mixture.py) changes only what an epoch is: source s fills
shares[s] of its positions (the sources' slots shuffled together by ``seed + e``) with the next rows
of its own endless stream of permutations, so every row of every source keeps coming back.

The state is global: the epoch and the position in its permutation. A checkpoint therefore resumes
at the same global position whatever the new world size is (same prompts, none repeated or
skipped: only which rank handles which prompt changes).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


class RLDataLoader:
    """Yields this rank's batch of rows for every step, forever."""

    def __init__(self, rows: list[dict], *, batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool = True, accept: Callable[[int, int, int], bool] | None = None,
                 sizes: list[int] | None = None, shares: list[int] | None = None) -> None:
        if not rows:
            raise ValueError("build_dataloader: no rows")
        if batch_size < 1:
            raise ValueError(f"build_dataloader: batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"build_dataloader: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.rows, self.batch_size, self.rank, self.world_size = rows, batch_size, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        # A curriculum's accept(row index, epoch, position) (train/datasets/curriculum.py); None: every row.
        self.accept = accept
        self.last_indices: list[int] = []
        # A weighted mixture: rows are the sources' rows one after the other, sizes[s] of them each,
        # and an epoch holds shares[s] rows of source s.
        if shares is not None and (sizes is None or len(sizes) != len(shares) or sum(sizes) != len(rows)):
            raise ValueError("build_dataloader: shares need the sizes of the sources, which must add up to the rows")
        self.sizes, self.shares = sizes, shares
        self.epoch_rows = sum(shares) if shares is not None else len(rows)
        self.global_batch = batch_size * world_size
        self.batches_per_epoch: int = math.ceil(self.epoch_rows / self.global_batch)
        self.epoch = 0
        self.cursor = 0  # rows of this epoch's permutation already used, all ranks together
        self._order: tuple[int, list[int]] | None = None

    def _shuffled(self, n: int, seed: int) -> list[int]:
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = (self._shuffled(len(self.rows), self.seed + epoch) if self.shares is None
                     else self._mixture_order(epoch))
            self._order = (epoch, order)
        return self._order[1]

    def _mixture_order(self, epoch: int) -> list[int]:
        """Epoch `epoch` of a weighted mixture: the sources' slots in a shuffled (or, unshuffled, evenly
        spread) order, slot by slot the next row of that source's stream. Source s has used
        epoch * shares[s] rows of its stream before this epoch, so no state beyond the epoch is needed."""
        sizes, shares = self.sizes, self.shares
        if self.shuffle:
            slots = [s for s, n in enumerate(shares) for _ in range(n)]
            slots = [slots[i] for i in self._shuffled(len(slots), self.seed + epoch)]
        else:  # source s's k-th slot at fraction (k + 1/2) / shares[s] of the epoch
            slots = [s for _, s in sorted(((k + 0.5) / n, s) for s, n in enumerate(shares) for k in range(n))]
        offsets = [sum(sizes[:s]) for s in range(len(sizes))]
        used = [epoch * n for n in shares]
        passes: dict[tuple[int, int], list[int]] = {}
        order = []
        for s in slots:
            k, j = divmod(used[s], sizes[s])
            used[s] += 1
            if (s, k) not in passes:  # pass k over source s: its own permutation
                passes[(s, k)] = self._shuffled(sizes[s], self.seed + 1_000_003 * (s + 1) + 7919 * k)
            order.append(offsets[s] + passes[(s, k)][j])
        return order

    def next_batch(self) -> list[dict]:
        """This rank's rows of the next global batch. With `accept`, candidates it refuses are passed
        over (their position is used up); after a whole epoch's worth of refusals in one batch the
        rest are taken as they come, so a batch always fills."""
        picked: list[int] = []
        refused = 0
        while len(picked) < self.global_batch:
            order = self._permutation(self.epoch)
            if self.accept is None:
                take = min(self.global_batch - len(picked), len(order) - self.cursor)
                picked += order[self.cursor:self.cursor + take]
                self.cursor += take
            else:
                index, epoch, position = order[self.cursor], self.epoch, self.cursor
                self.cursor += 1
                if refused >= len(order) or self.accept(index, epoch, position):
                    picked.append(index)
                else:
                    refused += 1
            if self.cursor == len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
        self.last_indices = picked[self.rank::self.world_size]  # this rank's rows, as indices into `rows`
        return [self.rows[i] for i in self.last_indices]

    def state_dict(self) -> dict:
        """The global position: the same on every rank."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a :meth:`state_dict`'s position (saved by any number of ranks)."""
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def build_dataloader(rows: list[dict], **kwargs) -> RLDataLoader:
    """Build the loader of one rank (keywords as `RLDataLoader`: batch_size per rank, rank,
    world_size, seed, shuffle)."""
    return RLDataLoader(rows, **kwargs)
