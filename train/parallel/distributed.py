"""Process-group set-up: every rank joins the torchrun group (gloo on CPU, NCCL on GPU).

Everything is passed explicitly through a `DistContext`; nothing lives in module state. The few
collectives the trainer issues itself are in train/parallel/collectives.py.
"""
from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train.parallel.rollout_bridge import Bridge, WorldSplit, split_world


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: DeviceMesh | None  # 1-D data-parallel mesh ("dp"); TP/SP meshes slot in beside it (None: a rollout rank)
    collective_timeout_s: float = 1800.0  # every process group's (trainer.collective_timeout_s)
    split: WorldSplit | None = None  # with rollout.ranks > 0: trainer ranks and rollout ranks
    bridge: Bridge | None = None  # messages between the two sides (train/parallel/rollout_bridge.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_rollout_rank(self) -> bool:
        return self.split is not None and self.split.is_rollout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What torchrun (or a one-process `init_distributed`) puts in the environment: a rank and a rendezvous.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT")


def without_launcher_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less the launcher's rank and rendezvous variables (LAUNCHER_ENV, TORCHELASTIC_*): for a child
    process that starts its own group. With them it would join its parent's port (EADDRINUSE) as its rank 0."""
    return {k: v for k, v in env.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}


def run_device_type() -> str:
    """The device type a run takes on this machine: "cuda" where a GPU is visible, else "cpu" (the one rule;
    `init_distributed` and the config's device defaults both ask it)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float = 1800, rollout_ranks: int = 0, bridge_timeout_s: float = 1800) -> DistContext:
    """Join the torchrun process group (gloo on CPU, nccl on GPU); a plain `python -m`
    launch becomes a one-rank group so the same code path runs everywhere. With `rollout_ranks` K > 0
    the last K ranks become rollout ranks: the default group (and `world_size`, the mesh) spans the
    trainer ranks only, and a rollout rank gets no mesh (train/parallel/rollout_bridge.py)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if run_device_type() == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend, device_type = "nccl", "cuda"
    else:
        device, backend, device_type = torch.device("cpu"), "gloo", "cpu"
    split, bridge = None, None
    if rollout_ranks:
        split, bridge = split_world(rollout_ranks, backend, bridge_timeout_s)
        if split.is_rollout:
            return DistContext(rank, world, local_rank, local_world, device, None, float(timeout_s), split, bridge)
        world = split.trainers
    elif not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    return DistContext(rank, world, local_rank, local_world, device, mesh, float(timeout_s), split, bridge)


def set_cpu_threads(ctx: DistContext, num_threads: int | None) -> None:
    """Torch threads of a CPU rank: `trainer.num_threads`, else the cores shared by the node's ranks."""
    if ctx.device.type == "cpu":
        torch.set_num_threads(num_threads or max(1, (os.cpu_count() or 1) // ctx.local_world_size))


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
