"""actor.offload_optimizer (train/models/optim.py HostMoments): the AdamW moments wait in host slabs between
optimizer steps and the step runs a bucket of parameters at a time; training is the same bit for bit as with the
moments left in place, and a checkpoint resumes exactly."""
import pytest
import torch

from conftest import launch_check as launch, slow


@pytest.mark.parametrize("ranks", [1, slow(2)])
def test_updates_with_the_moments_offloaded_equal_updates_without_bit_for_bit(tmp_path, ranks):
    """Three updates each, the actor built the way the trainer builds it (FSDP2: DTensor moments; bf16 with fp32
    masters: plain ones), buckets of 64 KiB of moments: the step runs a bucket at a time with only that bucket's
    moments off the host. On a CPU the moments still go out of their slab for the step and back into it after. A
    checkpoint saved (train/runtime/checkpoint.py) while they wait in the slabs resumes exactly."""
    out = launch(ranks, tmp_path / "moments.pt", "offload_moments", "--max_tokens", "64", "--bucket_kb", "64")
    for masters in (False, True) if ranks == 1 else (False,):  # (fp32 masters: one process only)
        kept, offloaded = out[(masters, False)], out[(masters, True)]
        assert all(s["masters"] == masters for s in kept + offloaded)
        for step, (a, b) in enumerate(zip(kept, offloaded)):
            assert a["weights"].keys() == b["weights"].keys()
            for name, w in a["weights"].items():
                assert torch.equal(w, b["weights"][name]), (masters, step, name)
            assert a["pieces"] == 0 and a["host_bytes"] == 0 and a["on_device"] == []  # (no setting: no slab)
            # AdamW's two float32 moments per trainable parameter of this rank, all on the host between steps,
            # one slab per bucket
            assert b["devices"] == ["cpu"] and b["buckets"] > 2 and b["storages"] == b["buckets"]
            whole = 2 * 4 * b["trainable"]  # (a rank holds its shard's rows: the first rank at least half)
            assert b["piece_bytes"] == whole if ranks == 1 else whole // ranks <= b["piece_bytes"] < whole
            assert b["piece_bytes"] <= b["host_bytes"] <= b["piece_bytes"] + 512 * b["pieces"]
            assert b["metric"] == b["host_bytes"] / 2**30 and a["metric"] is None  # memory/actor_moments_host_gib
            # one AdamW call per bucket, each with that bucket's moments alone off the host
            assert len(b["on_device"]) == b["buckets"] and sum(b["on_device"]) == b["piece_bytes"]
            assert max(b["on_device"]) <= max(b["limit"], b["largest"]) < b["piece_bytes"]
        assert len({s["storage"] for s in offloaded}) == 1  # laid out at the first step, reused after
        assert any(not torch.equal(kept[0]["weights"][n], kept[2]["weights"][n]) for n in kept[0]["weights"])
        # a checkpoint saved after the second update, with the moments in the slabs, resumes the third exactly;
        # loading it into a new actor makes the state first on the host a bucket at a time (one AdamW call at
        # learning rate 0 each, only that bucket off the host), not all at once on the device as DCP would
        buckets = offloaded[0]["buckets"]
        assert len(out[(masters, "load_on_device")]) == buckets
        assert max(out[(masters, "load_on_device")]) <= max(offloaded[0]["limit"], offloaded[0]["largest"])
        assert out[(masters, "loaded_devices")] == ["cpu"] and out[(masters, "loaded_storages")] == buckets
        # dcp.load wrote the values into the slabs in place; torch's load_state_dict, which would copy each one to
        # its parameter's device (all at once for fp32 masters), loads only the param groups
        assert out[(masters, "load_casts")] == 0
        resumed = out[(masters, "resumed")]
        assert resumed.keys() == kept[2]["weights"].keys()
        assert all(torch.equal(w, kept[2]["weights"][n]) for n, w in resumed.items())
