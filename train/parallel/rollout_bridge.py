"""Dedicated rollout ranks (`rollout.ranks=K`): the last K ranks of the torchrun group only generate and
score; the first N-K only train.

The world is split before any process group exists, so the training side's code is unchanged: its
default group (and every mesh, DCP checkpoint and collective on it) spans the N-K trainer ranks only,
ranks 0..N-K-1 as before. Two more gloo groups are built over the same torchrun store:

- the **bridge**, all N ranks: point-to-point messages (pickled objects) between a trainer rank and
  its rollout rank (trainer r is served by rollout rank N-K + r mod K): requests, samples, checksums;
- the **push group**, trainer rank 0 and the K rollout ranks: weight buckets, broadcast from trainer 0.

Every wait on either group has a timeout and a message naming the side, the peer and what it waited
for. Module state: none; everything lives in the `Bridge` the caller holds.
"""
from __future__ import annotations

import datetime
import os
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


class BridgeError(RuntimeError):
    """A trainer rank or a rollout rank waited for the other past the timeout, or lost it."""


@dataclass(frozen=True)
class WorldSplit:
    """Where this process sits when `rollout.ranks` > 0 (global ranks: trainers first)."""
    rank: int  # global (torchrun) rank
    world_size: int  # all ranks
    rollout_ranks: int  # K

    @property
    def trainers(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.trainers

    def server_of(self, trainer: int) -> int:
        """The global rank of the rollout rank serving trainer rank `trainer`."""
        return self.trainers + trainer % self.rollout_ranks

    def clients_of(self, server: int) -> list[int]:
        """The trainer ranks a rollout rank (global rank `server`) serves, in order."""
        return list(range(server - self.trainers, self.trainers, self.rollout_ranks))


def _store(rank: int, timeout: datetime.timedelta) -> dist.Store:
    """The torchrun store (its agent's when it offers one), under a prefix of this attempt."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    base = dist.TCPStore(host, port, is_master=rank == 0 and not agent, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"infinite_rl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def _to_bytes(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _from_bytes(payload: torch.Tensor) -> object:
    return pickle.loads(payload.numpy().tobytes())


class Bridge:
    """Messages between trainer ranks and rollout ranks, and the weight broadcast."""

    def __init__(self, split: WorldSplit, store: dist.Store, timeout_s: float) -> None:
        self.split, self.timeout_s = split, float(timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), split.rank, split.world_size, timeout)
        members = [0, *range(split.trainers, split.world_size)]
        self.push_pg = (dist.ProcessGroupGloo(dist.PrefixStore("push", store), members.index(split.rank),
                                              len(members), timeout)
                        if split.rank in members else None)

    def _wait(self, work: dist.Work, timeout_s: float | None, what: str) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            side = "rollout" if self.split.is_rollout else "trainer"
            if time.monotonic() - start < 0.99 * timeout_s:  # not a timeout: the peer's connection closed
                raise BridgeError(f"{side} rank {self.split.rank} lost the other side while waiting {what}: that rank "
                                    f"failed or exited (its own error says why; {str(e).splitlines()[0][:200]})") from None
            raise BridgeError(f"{side} rank {self.split.rank} waited {timeout_s:.0f} s (rollout.async_timeout_s) "
                                f"{what}; the other side is stuck") from None

    def send(self, obj: object, dst: int, what: str) -> None:
        """Send a picklable object to global rank `dst`."""
        payload = _to_bytes(obj)
        self._wait(self.pg.send([torch.tensor([payload.numel()], dtype=torch.int64)], dst, 0), None,
                   f"to send {what} to rank {dst}")
        self._wait(self.pg.send([payload], dst, 0), None, f"to send {what} to rank {dst}")

    def recv(self, src: int, what: str, timeout_s: float | None = None) -> object:
        """The next object global rank `src` sent; `what` names it in a timeout's message."""
        size = torch.empty(1, dtype=torch.int64)
        self._wait(self.pg.recv([size], src, 0), timeout_s, f"for {what} from rank {src}")
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self.pg.recv([payload], src, 0), timeout_s, f"for {what} from rank {src}")
        return _from_bytes(payload)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Broadcast a CPU tensor from trainer rank 0 over the push group (in place on the others)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self._wait(self.push_pg.broadcast([tensor], opts), None, what)

    def broadcast_object(self, obj: object | None, what: str) -> object:
        """`obj` from trainer rank 0 to the rollout ranks (pass None on the receiving side)."""
        payload = _to_bytes(obj) if obj is not None else None
        size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
        self.broadcast(size, what)
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast(payload, what)
        return _from_bytes(payload)


def split_world(rollout_ranks: int, backend: str, timeout_s: float) -> tuple[WorldSplit, Bridge]:
    """Join this rank's side: a trainer rank initialises the default process group over the trainer
    ranks only; a rollout rank initialises none. Both join the bridge and (trainer 0 and the rollout
    ranks) the push group."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    split = WorldSplit(rank, world, rollout_ranks)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _store(rank, timeout)
    if not split.is_rollout:
        dist.init_process_group(backend, store=dist.PrefixStore("trainers", store), rank=rank,
                                world_size=split.trainers, timeout=timeout)
    return split, Bridge(split, store, timeout_s)
