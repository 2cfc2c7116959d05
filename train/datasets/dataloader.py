"""An endless, resumable stream of prompt batches, split over data-parallel ranks.

Every rank walks the same global sequence: epoch e is a permutation of the rows seeded by
``seed + e`` (the order PyTorch's ``DistributedSampler`` uses), epochs follow each other without a
gap, and step k takes the next ``batch_size * world_size`` rows of that stream; rank r keeps every
world_size-th of them, starting at r. Every batch is full (the stream runs into the next epoch),
every rank has the same number of rows, and fewer rows than ranks simply repeat.

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
                 shuffle: bool = True, accept: Callable[[int, int, int], bool] | None = None) -> None:
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
        self.global_batch = batch_size * world_size
        self.batches_per_epoch: int = math.ceil(len(rows) / self.global_batch)
        self.epoch = 0
        self.cursor = 0  # rows of this epoch's permutation already used, all ranks together
        self._order: tuple[int, list[int]] | None = None

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(len(self.rows), generator=g).tolist()
            else:
                order = list(range(len(self.rows)))
            self._order = (epoch, order)
        return self._order[1]

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
