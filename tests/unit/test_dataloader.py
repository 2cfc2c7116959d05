import json

import pytest
import torch

from train.datasets.dataloader import build_dataloader

ROWS = [{"i": i} for i in range(10)]


def _ids(batch):
    return [r["i"] for r in batch]


def _loader(rows=ROWS, **kw):
    args = dict(batch_size=3, rank=0, world_size=2, seed=7)
    args.update(kw)
    return build_dataloader(rows, **args)


def _take(loader, n):
    return [_ids(loader.next_batch()) for _ in range(n)]


def _global(rows, world, steps, batch=3, seed=7, state=None):
    """The rows of every step, all ranks together, in rank-interleaved order."""
    loaders = [build_dataloader(rows, batch_size=batch, rank=r, world_size=world, seed=seed) for r in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        parts = [_ids(loader.next_batch()) for loader in loaders]
        out.append(sorted(i for p in parts for i in p))
    return out, loaders[0].state_dict()


def test_the_stream_follows_the_seeded_permutations_without_gaps():
    """Epoch e is torch.randperm(n) seeded with seed + e (DistributedSampler's order); steps take the
    next world x batch rows of the stream, rank r every world-th from r; batches are always full."""
    perm = lambda e: torch.randperm(10, generator=torch.Generator().manual_seed(7 + e)).tolist()  # noqa: E731
    stream = perm(0) + perm(1) + perm(2)
    loaders = [_loader(rank=r) for r in range(2)]
    assert loaders[0].batches_per_epoch == 2  # ceil(10 rows / 6 per step)
    for step in range(4):
        chunk = stream[6 * step: 6 * (step + 1)]
        for r, loader in enumerate(loaders):
            assert _ids(loader.next_batch()) == chunk[r::2]
    assert loaders[0].state_dict() == {"epoch": 2, "cursor": 4}


def test_batches_are_row_dicts_unchanged():
    rows = [{"messages": [{"role": "user", "content": "q"}], "answer": [1, {"a": None}]}]
    batch = build_dataloader(rows, batch_size=1, rank=0, world_size=1, seed=0).next_batch()
    assert batch == rows and batch[0] is rows[0]


@pytest.mark.parametrize("stop", range(0, 9))
def test_resume_gives_same_sequence(stop):
    # Stops cover the start, mid-epoch, right after an epoch's last batch and later epochs.
    total = 9
    straight = _loader()
    expected = _take(straight, total)
    first = _loader()
    head = _take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints must survive serialisation
    resumed = _loader()
    resumed.load_state_dict(state)
    assert head + _take(resumed, total - stop) == expected
    assert resumed.state_dict() == straight.state_dict()


@pytest.mark.parametrize("world_after", [1, 3, 6])
def test_resume_on_another_world_size_takes_the_same_prompts(world_after):
    """2 ranks x 3 rows, then resumed on 1, 3 or 6 ranks with the same global batch of 6: the same
    rows step after step, none repeated or skipped."""
    rows = [{"i": i} for i in range(23)]
    straight, _ = _global(rows, 2, 8)
    head, state = _global(rows, 2, 3)
    tail, _ = _global(rows, world_after, 5, batch=6 // world_after, state=json.loads(json.dumps(state)))
    assert head + tail == straight


def test_two_ranks_disjoint_and_covering():
    rows = [{"i": i} for i in range(12)]
    seen = []
    for rank in range(2):
        loader = build_dataloader(rows, batch_size=2, rank=rank, world_size=2, seed=3)
        assert loader.batches_per_epoch == 3
        seen.append([i for b in _take(loader, 3) for i in b])
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(12))


def test_epochs_reshuffled_differently():
    rows = [{"i": i} for i in range(32)]
    loader = build_dataloader(rows, batch_size=16, rank=0, world_size=1, seed=0)
    epochs = [[i for b in _take(loader, 2) for i in b] for _ in range(3)]
    assert all(sorted(e) == list(range(32)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    # Same seed -> same order on a fresh loader; another seed -> another order.
    again = build_dataloader(rows, batch_size=16, rank=0, world_size=1, seed=0)
    assert [i for b in _take(again, 2) for i in b] == epochs[0]
    other = build_dataloader(rows, batch_size=16, rank=0, world_size=1, seed=1)
    assert [i for b in _take(other, 2) for i in b] != epochs[0]


def test_no_shuffle_keeps_order():
    loader = build_dataloader(ROWS, batch_size=4, rank=0, world_size=1, seed=0, shuffle=False)
    assert _take(loader, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]  # full batches across epochs


def test_one_row_two_ranks():
    rows = [{"i": 0}]
    for rank in range(2):
        loader = build_dataloader(rows, batch_size=2, rank=rank, world_size=2, seed=0)
        assert loader.batches_per_epoch == 1
        assert _take(loader, 3) == [[0, 0], [0, 0], [0, 0]]
        assert loader.epoch == 12  # four rows a step, one row an epoch


def test_bad_arguments():
    with pytest.raises(ValueError, match="no rows"):
        build_dataloader([], batch_size=1, rank=0, world_size=1, seed=0)
    with pytest.raises(ValueError, match="rank"):
        build_dataloader(ROWS, batch_size=1, rank=2, world_size=2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        build_dataloader(ROWS, batch_size=0, rank=0, world_size=2, seed=0)
