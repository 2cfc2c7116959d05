"""Host memory the `hf` engine's sleep (and actor.offload_optimizer) holds: slabs against pinned copies per tensor.

    .venv/bin/python benchmarks/sleep_host_bytes.py      # seconds; models built on the meta device

On a GPU, `HFEngine.sleep()` copies the weights it owns to host memory. torch's pinned allocator
(`torch.empty(..., pin_memory=True)`, what the engine used before) rounds every block up to a power of two, so
each tensor took the next power of two of its bytes; train/utils/host_slab.py lays them out in one buffer of
exactly their bytes (each rounded up to 512) and page-locks it in place. This counts both for the bf16 weights
of the presets of train/models/memory_plan.py, taking the tensors the way the engine does (every parameter and
buffer once; tied weights once), and the one-block alternative (the whole model in one pinned allocation, also
rounded to a power of two). Arithmetic on the shapes of a meta-device model: torch's rounding rule is
`PowerOf2Ceil` in aten's CachingHostAllocator.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.models.memory_plan import GIB, PRESETS, preset_config  # noqa: E402
from train.models.vlm import model_class  # noqa: E402
from train.utils.host_slab import slab_layout, tensor_bytes  # noqa: E402


def power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def engine_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer once, as HFEngine.sleep takes them."""
    named = dict(model.state_dict(keep_vars=True))
    for name, buf in model.named_buffers():
        named.setdefault(name, buf)
    return list({id(t): t for t in named.values()}.values())


def count(name: str) -> dict:
    config = preset_config(name)
    with torch.device("meta"):
        model = model_class(config).from_config(config).to(torch.bfloat16)
    tensors = engine_tensors(model)
    exact = sum(tensor_bytes(t) for t in tensors)
    return {"model": name, "tensors": len(tensors), "weights": exact, "slab": slab_layout(tensors)[1],
            "per_tensor": sum(power_of_two(tensor_bytes(t)) for t in tensors), "one_block": power_of_two(exact)}


def count_moments(name: str) -> dict:
    """actor.offload_optimizer on a full fine-tune: AdamW's two float32 moments of every parameter (one process).
    Before, each moment tensor went to the host with `.to("cpu", non_blocking=True)`, which torch allocates pinned
    (a power of two each); now one slab per bucket of parameters (optim.HostMoments)."""
    config = preset_config(name)
    with torch.device("meta"):
        model = model_class(config).from_config(config)
    moments = [t for p in model.parameters() for t in (p, p)]  # exp_avg and exp_avg_sq: the parameter's shape, fp32
    exact = sum(tensor_bytes(t) for t in moments)
    return {"model": name, "tensors": len(moments), "weights": exact, "slab": slab_layout(moments)[1],
            "per_tensor": sum(power_of_two(tensor_bytes(t)) for t in moments), "one_block": power_of_two(exact)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen3-4b,llama3.1-8b,qwen3-8b,qwen3-32b",
                    help=f"comma-separated presets of {', '.join(PRESETS)}")
    args = ap.parse_args(argv)
    print("| model | tensors | bf16 weights | pinned per tensor (before) | one pinned block | slab (now) "
          "| per tensor / slab |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        print(row(count(name)))
    print("\nactor.offload_optimizer, a full fine-tune's AdamW moments (float32, two per parameter):\n")
    print("| model | tensors | moments | pinned per tensor (before) | one pinned block | slabs (now) "
          "| per tensor / slabs |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        print(row(count_moments(name)))
    return 0


def row(r: dict) -> str:
    return (f"| {r['model']} | {r['tensors']} | {r['weights'] / GIB:.2f} GiB | {r['per_tensor'] / GIB:.2f} GiB "
            f"| {r['one_block'] / GIB:.2f} GiB | {r['slab'] / GIB:.2f} GiB | {r['per_tensor'] / r['slab']:.2f}x |")


if __name__ == "__main__":
    raise SystemExit(main())
