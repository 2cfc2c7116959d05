"""An endless, resumable, rank-sharded loader over prompt rows.

Each data-parallel rank builds its own loader with the same rows and seed: a ``DistributedSampler``
gives every rank a disjoint shard of a permutation that depends only on ``seed + epoch``, and the
``StatefulDataLoader`` remembers how far into that permutation the rank got, so a checkpoint restores
the exact next batch.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


class _RowDataset(Dataset):
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def _collate_rows(batch: list[dict]) -> list[dict]:
    # Rows are ragged (messages, arbitrary answers): keep them as a plain list of dicts.
    return batch


class RLDataLoader:
    """Yields per-rank batches of rows forever, moving to the next (reshuffled) epoch by itself."""

    def __init__(
        self,
        rows: list[dict],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if not rows:
            raise ValueError("build_dataloader: no rows")
        if batch_size < 1:
            raise ValueError(f"build_dataloader: batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"build_dataloader: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        # The sampler never drops rows: with drop_last=False it pads by repeating rows so every rank
        # has the same number of samples (and so the same number of batches: no rank waits forever
        # in a collective). Fewer rows than ranks is fine: ranks then share repeated rows.
        self.sampler = DistributedSampler(
            _RowDataset(rows), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=False
        )
        per_rank = self.sampler.num_samples  # identical on every rank
        self.batches_per_epoch: int = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"build_dataloader: {len(rows)} rows give {per_rank} per rank, fewer than batch_size={batch_size} "
                "with drop_last=True, so an epoch would have no batch"
            )
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, which newer torch deprecates: noise, not a problem.
            warnings.filterwarnings("ignore", message=".*set_vital.*deprecated", category=UserWarning)
            self.loader = StatefulDataLoader(
                self.sampler.dataset,
                batch_size=batch_size,
                sampler=self.sampler,
                num_workers=0,
                collate_fn=_collate_rows,
                drop_last=drop_last,
            )
        self.epoch: int = 0
        self._iter: Any = None

    def _start_epoch(self) -> None:
        # set_epoch makes the permutation seed + epoch, so each epoch is shuffled differently but
        # identically on all ranks.
        self.sampler.set_epoch(self.epoch)
        self._iter = iter(self.loader)

    def next_batch(self) -> list[dict]:
        """The next batch of this rank; after the last batch of an epoch, the first of the next."""
        if self._iter is None:
            self._start_epoch()
        try:
            return next(self._iter)
        except StopIteration:
            self.epoch += 1
            self._start_epoch()
            return next(self._iter)

    def state_dict(self) -> dict:
        """Position to resume from: the epoch and the StatefulDataLoader's place in it."""
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`; the next :meth:`next_batch` is the batch that would have come next."""
        self.epoch = int(state["epoch"])
        # The sampler's epoch must be set before the loader fast-forwards through it, so the skipped
        # indices are those of the saved epoch's permutation.
        self.sampler.set_epoch(self.epoch)
        self.loader.load_state_dict(state["loader"])
        self._iter = iter(self.loader)


def build_dataloader(rows: list[dict], **kwargs: Any) -> RLDataLoader:
    """Build the loader of one rank (keywords as `RLDataLoader`: batch_size per rank, rank,
    world_size, seed, shuffle, drop_last)."""
    return RLDataLoader(rows, **kwargs)
