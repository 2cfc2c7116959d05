"""Process-group set-up: every rank joins the torchrun group (gloo on CPU, NCCL on GPU).

Everything is passed explicitly through a `DistContext`; nothing lives in module state. The few
collectives the trainer issues itself are in train/parallel/collectives.py.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: DeviceMesh  # 1-D data-parallel mesh ("dp"); TP/SP meshes slot in beside it
    collective_timeout_s: float = 1800.0  # every process group's (trainer.collective_timeout_s)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 1800) -> DistContext:
    """Join the torchrun process group (gloo on CPU, nccl on GPU); a plain `python -m`
    launch becomes a one-rank group so the same code path runs everywhere."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend, device_type = "nccl", "cuda"
    else:
        device, backend, device_type = torch.device("cpu"), "gloo", "cpu"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    return DistContext(rank, world, local_rank, local_world, device, mesh, float(timeout_s))


def mesh_overrides(device_type: str, dim_names: tuple[str, ...], timeout_s: float | None) -> dict | None:
    """`init_device_mesh(backend_override=...)` giving every sub-group `timeout_s` (torch gives groups
    that span fewer ranks than the world its own 30-minute default, whatever the world group has)."""
    cuda = device_type == "cuda"
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    if timeout is None or timeout == (default_pg_nccl_timeout if cuda else default_pg_timeout):
        return None  # torch's own groups already wait this long (and dims spanning the world reuse its group)
    options = dist.ProcessGroupNCCL.Options() if cuda else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return {name: ("nccl" if cuda else "gloo", options) for name in dim_names}


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
