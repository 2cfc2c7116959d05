import json

import pytest

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


def test_batches_per_epoch_and_epoch_advance():
    loader = _loader()
    assert loader.batches_per_epoch == 2  # 5 rows per rank -> batches of 3 and 2
    assert [len(b) for b in _take(loader, 2)] == [3, 2]
    assert loader.epoch == 0
    loader.next_batch()
    assert loader.epoch == 1
    assert _loader(drop_last=True).batches_per_epoch == 1


def test_batches_are_row_dicts_unchanged():
    rows = [{"messages": [{"role": "user", "content": "q"}], "answer": [1, {"a": None}]}]
    batch = build_dataloader(rows, batch_size=4, rank=0, world_size=1, seed=0).next_batch()
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
    assert resumed.epoch == straight.epoch


def test_resume_epoch_counter():
    a = _loader()
    _take(a, 3)  # epoch 1, mid-epoch
    b = _loader()
    b.load_state_dict(a.state_dict())
    assert b.epoch == 1
    _take(b, 2)
    assert b.epoch == 2


def test_two_ranks_disjoint_and_covering():
    rows = [{"i": i} for i in range(12)]
    seen = []
    for rank in range(2):
        loader = build_dataloader(rows, batch_size=2, rank=rank, world_size=2, seed=3)
        assert loader.batches_per_epoch == 3
        seen.append([i for b in _take(loader, 3) for i in b])
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(12))


def test_uneven_rows_pad_with_equal_batch_counts():
    rows = [{"i": i} for i in range(5)]
    loaders = [build_dataloader(rows, batch_size=2, rank=r, world_size=2, seed=0) for r in range(2)]
    assert [l.batches_per_epoch for l in loaders] == [2, 2]
    seen = [i for l in loaders for b in _take(l, 2) for i in b]
    assert len(seen) == 6 and set(seen) == set(range(5))  # one row repeated as padding


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
    loader = build_dataloader(ROWS, batch_size=5, rank=0, world_size=1, seed=0, shuffle=False)
    assert _take(loader, 3) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]


def test_one_row_two_ranks():
    rows = [{"i": 0}]
    for rank in range(2):
        loader = build_dataloader(rows, batch_size=4, rank=rank, world_size=2, seed=0)
        assert loader.batches_per_epoch == 1
        assert _take(loader, 3) == [[0], [0], [0]]
        assert loader.epoch == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="no rows"):
        build_dataloader([], batch_size=1, rank=0, world_size=1, seed=0)
    with pytest.raises(ValueError, match="rank"):
        build_dataloader(ROWS, batch_size=1, rank=2, world_size=2, seed=0)
    with pytest.raises(ValueError, match="no batch"):
        build_dataloader(ROWS, batch_size=6, rank=0, world_size=2, seed=0, drop_last=True)
