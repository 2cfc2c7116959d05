"""Run under `torchrun --nproc_per_node=2` (gloo, CPU) by tests/integration/test_sglang_adapter.py: the sglang
adapter with tp_size=2 over the RECORDING FAKE engine (tests/fake_sglang.py). Rank 0 owns the engine,
rank 1 forwards its prompts. Writes rank{N}.json into --out."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_sglang import expected_tokens, fake_bindings  # noqa: E402

from train.engines.base import SamplingParams  # noqa: E402
from train.engines.sglang import SGLangEngine  # noqa: E402

PROMPTS_PER_RANK = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)  # same full weights on both ranks, then sharded like FSDP
    full = {"model.embed.weight": torch.randn(16, 8), "model.layer.weight": torch.randn(6, 8),
            "lm_head.weight": torch.randn(32, 8)}
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}

    calls: list = []
    bindings, engines = fake_bindings(calls, delay_s=0.02)
    engine = SGLangEngine("fake/model", rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                          tp_size=2, bindings=bindings, device="cpu", bucket_size_mb=0.001, base_port=32000,
                          offload_weights=True)
    loop = asyncio.new_event_loop()  # like RolloutWorker: one loop per rank, not the engine's
    prompts = [[rank * 10 + i, 2, 3] for i in range(PROMPTS_PER_RANK)]
    sp = SamplingParams(max_new_tokens=5)

    async def rollout(delay: float):
        await asyncio.sleep(delay)
        return await asyncio.gather(*(engine.generate(p, sp) for p in prompts))

    # The feeder starts late: the owner reaches sleep() first and must keep serving it meanwhile.
    before = loop.run_until_complete(rollout(1.0 if rank == 1 else 0.0))
    engine.sleep()
    engine.update_weights(sharded.items())
    after = loop.run_until_complete(rollout(0.0))
    dist.barrier()
    engine.close()
    loop.close()

    result = {
        "is_owner": engine.group.is_owner,
        "engines_built": len(engines),
        "before": [g.token_ids for g in before],
        "after": [g.token_ids for g in after],
        "want_before": [expected_tokens(p, 5, version=0) for p in prompts],
        "want_after": [expected_tokens(p, 5, version=1) for p in prompts],
        "prompts_per_rank": PROMPTS_PER_RANK,
    }
    if engines:
        fake = engines[0]
        result.update(
            sequence=[n for n, _ in calls if n not in ("__init__", "async_generate")],
            payloads_per_call=[len(kw["named_tensors"]) for n, kw in calls if n == "update_weights_from_tensor"],
            loaded_names=list(fake.loaded),
            model_names=list(full),
            loaded_equal=all(torch.equal(fake.loaded[k], v.to(torch.bfloat16)) for k, v in full.items()),
            requests_served=sum(1 for n, _ in calls if n == "async_generate") // 2,  # two rollouts
        )
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
