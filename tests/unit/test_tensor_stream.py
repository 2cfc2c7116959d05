"""Grouping a push's stream of tensors (train/utils/tensor_stream.py): what the engine's batched copy and
both sides' batched checksums see. Every pair once, in order; a group's tensors and the buffers they keep
alive stay within the limit (a larger first tensor or buffer alone excepted)."""
import torch

from train.utils.tensor_stream import grouped


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_groups_keep_every_pair_in_order_within_the_byte_limits():
    bucket = torch.zeros(1000)  # a gathered bucket: 4000 bytes, its tensors are views
    views = [(f"v{i}", bucket[i * 100:(i + 1) * 100]) for i in range(10)]
    fresh = [(f"f{i}", torch.zeros(n)) for i, n in enumerate([10, 300, 2000, 5, 5])]
    other = torch.zeros(200)
    stream = fresh[:2] + views + fresh[2:] + [("o0", other[:100]), ("o1", other[100:])]
    groups = list(grouped(iter(stream), max_bytes=1600))
    assert [n for g in groups for n, _ in g] == [n for n, _ in stream]
    for g in groups:
        size = sum(_nbytes(t) for _, t in g)
        bases = {id(t._base if t._base is not None else t): t._base if t._base is not None else t for _, t in g}
        held = sum(_nbytes(b) for b in bases.values())
        assert size <= 1600 or len(g) == 1
        assert held <= 1600 or len(bases) == 1, [n for n, _ in g]  # a larger buffer: alone
    # views of a buffer larger than the limit stay together up to the tensor limit, and no other buffer joins
    # them; views of a small buffer join other tensors
    assert [[n for n, _ in g] for g in groups] == [["f0", "f1"], ["v0", "v1", "v2", "v3"], ["v4", "v5", "v6", "v7"],
                                                 ["v8", "v9"], ["f2"], ["f3", "f4", "o0", "o1"]]


def test_a_stream_of_plain_tensors_is_one_group_when_it_fits():
    stream = [(str(i), torch.zeros(8)) for i in range(300)]
    groups = list(grouped(stream, max_bytes=1 << 20))
    assert len(groups) == 1 and len(groups[0]) == 300
