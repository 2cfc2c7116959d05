"""Dedicated rollout ranks (`rollout.ranks=K`): the last K ranks of the torchrun group only generate and
score; the first N-K only train.

The world is split before any process group exists, so the training side's code is unchanged: its
default group (and every mesh, DCP checkpoint and collective on it) spans the N-K trainer ranks only,
ranks 0..N-K-1 as before. Two more gloo groups are built over the same torchrun store:

- the **bridge**, all N ranks: point-to-point messages (pickled objects) between a trainer rank and
  its rollout rank (trainer r is served by rollout rank N-K + r mod K): requests, samples, checksums;
- the **push group**, trainer rank 0 and the K rollout ranks: weight buckets, broadcast from trainer 0.

Every wait on either group has a timeout and ends in one line naming this rank, the peer, the request
and `rollout.async_timeout_s` (a `BridgeError`, which the trainer prints as its `error:` line); a
trainer rank's line adds what its rollout rank was doing, which each rollout rank publishes a few
times a second in the store (`publish_status`: e.g. the env call in flight the longest), or that it
stopped answering (no status for `SILENT_AFTER_S`: stopped, swapped out, hung). Module state: none;
everything lives in the `Bridge` the caller holds.
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class BridgeError(RuntimeError):
    """A trainer rank or a rollout rank waited for the other past the timeout, or lost it."""


TIMEOUT_KEY = "rollout.async_timeout_s"  # the bridge's timeout, named in its errors
STATUS_EVERY_S = 0.5  # how often a rollout rank publishes its status (train/workers/rollout_server.py)
SILENT_AFTER_S = 3.0  # a status older than this: the rank stopped answering (stopped, swapped out, hung)
STATUS_READ_S = 2.0  # the status store's own timeout: reading it never holds an error up for long


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


def _store(rank: int, timeout: datetime.timedelta, client: bool = False) -> dist.Store:
    """The torchrun store (its agent's when it offers one), under a prefix of this attempt; `client`:
    a connection of its own to it (never its server)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    base = dist.TCPStore(host, port, is_master=rank == 0 and not agent and not client, timeout=timeout,
                         wait_for_workers=False)
    return dist.PrefixStore(f"infinite_rl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def _first_words(error: Exception) -> str:
    """gloo's error without its boilerplate ("... closed by peer [host]:port")."""
    return str(error).splitlines()[0].split(". This is typically")[0][:200]


def _to_bytes(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _from_bytes(payload: torch.Tensor) -> object:
    return pickle.loads(payload.numpy().tobytes())


class Bridge:
    """Messages between trainer ranks and rollout ranks, and the weight broadcast.

    Every wait ends, past its timeout or when the other side is lost, in a BridgeError of one line
    naming this rank, the peer, the request and `rollout.async_timeout_s` with its value; a trainer
    rank adds what its rollout rank was doing (its published status, e.g. the env call in flight)
    or that it stopped answering. A gloo link never recovers from a failure: later operations on a
    failed bridge raise the first failure again (another thread's wait may have closed the link)."""

    def __init__(self, split: WorldSplit, store: dist.Store, timeout_s: float,
                 status_store: dist.Store | None = None) -> None:
        self.split, self.timeout_s = split, float(timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), split.rank, split.world_size, timeout)
        members = [0, *range(split.trainers, split.world_size)]
        self.push_pg = (dist.ProcessGroupGloo(dist.PrefixStore("push", store), members.index(split.rank),
                                              len(members), timeout)
                        if split.rank in members else None)
        self.status_store = status_store  # rollout ranks' statuses (a short timeout of its own)
        self.failed: str | None = None  # the first failure's line
        self._lock = threading.Lock()
        self._waits: dict[int, tuple[str, list[int], float, float]] = {}  # in flight: what, peers, start, timeout

    def name(self, rank: int) -> str:
        return f"{'rollout' if rank >= self.split.trainers else 'trainer'} rank {rank}"

    def names(self, ranks: list[int]) -> str:
        side = "rollout" if ranks[0] >= self.split.trainers else "trainer"
        return f"{side} rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"

    # -- the rollout ranks' statuses -------------------------------------------------------------
    def publish_status(self, status: dict) -> None:
        """This rollout rank's status (what it is doing, the env call in flight the longest)."""
        if self.status_store is not None:
            self.status_store.set(f"status/{self.split.rank}", json.dumps({**status, "time": time.time()}))

    def peer_status(self, rank: int) -> str:
        """What rollout rank `rank` last said it was doing, or that it stopped answering ('' if unknown)."""
        if self.status_store is None or rank < self.split.trainers:
            return ""
        key = f"status/{rank}"
        try:
            if not self.status_store.check([key]):
                return f"{self.name(rank)} has published no status (it stopped answering before its set-up)"
            status = json.loads(self.status_store.get(key))
        except Exception:  # noqa: BLE001 - the store itself is gone: say nothing rather than fail differently
            return ""
        doing = status.get("phase", "?") + (f", {status['call']}" if status.get("call") else "")
        age = time.time() - float(status.get("time", 0.0))
        if age > SILENT_AFTER_S:
            return (f"{self.name(rank)} stopped answering: its last status, {age:.0f} s ago, said it was {doing} "
                    "(a stopped (SIGSTOP), swapped-out or hung process)")
        return f"{self.name(rank)} was {doing}"

    # -- waits -----------------------------------------------------------------------------------
    def _run(self, op: Callable[[], dist.Work], peers: list[int], timeout_s: float | None, what: str) -> None:
        """Start `op` and wait for it; `what` reads after "waited N s" (e.g. "for X from rollout rank 1")."""
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        if self.failed is not None:
            raise BridgeError(self._after_failure(what))
        key, start = object(), time.monotonic()
        with self._lock:
            self._waits[id(key)] = (what, peers, start, timeout_s)
        try:
            op().wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise BridgeError(self._failure(e, what, peers, start, timeout_s)) from None
        finally:
            with self._lock:
                self._waits.pop(id(key), None)

    def _me(self) -> str:
        return self.name(self.split.rank)

    def _after_failure(self, what: str) -> str:
        return f"{self.failed}; so {self._me()} stopped waiting {what}"

    def _failure(self, error: RuntimeError, what: str, peers: list[int], start: float, timeout_s: float) -> str:
        now = time.monotonic()
        with self._lock:
            if self.failed is not None:
                return self._after_failure(what)
            if now - start >= 0.99 * timeout_s:
                line = self._timed_out(what, peers, timeout_s)
            else:  # another wait timing out closes the link under this one: that wait is the cause
                late = [w for w in self._waits.values() if now - w[2] >= 0.99 * w[3]]
                if late:
                    line = self._timed_out(late[0][0], late[0][1], late[0][3])
                else:
                    line = (f"{self._me()} lost {self.names(peers)} while waiting {what}: that rank failed or exited "
                            f"(its own error says why; {_first_words(error)})")
            self.failed = line
            return line

    def _timed_out(self, what: str, peers: list[int], timeout_s: float) -> str:
        states = [s for s in (self.peer_status(p) for p in peers) if s]
        return (f"{self._me()} waited {timeout_s:g} s {what}{'; ' + '; '.join(states) if states else ''} "
                f"({TIMEOUT_KEY}={timeout_s:g}: raise it if the other side is busy, not stuck)")

    # -- messages --------------------------------------------------------------------------------
    def send(self, obj: object, dst: int, what: str) -> None:
        """Send a picklable object to global rank `dst`; `what` names it in an error."""
        payload = _to_bytes(obj)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        wait = f"to send {what} to {self.name(dst)}"
        self._run(lambda: self.pg.send([size], dst, 0), [dst], None, wait)
        self._run(lambda: self.pg.send([payload], dst, 0), [dst], None, wait)

    def recv(self, src: int, what: str, timeout_s: float | None = None) -> object:
        """The next object global rank `src` sent; `what` names it in an error."""
        size = torch.empty(1, dtype=torch.int64)
        wait = f"for {what} from {self.name(src)}"
        self._run(lambda: self.pg.recv([size], src, 0), [src], timeout_s, wait)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._run(lambda: self.pg.recv([payload], src, 0), [src], timeout_s, wait)
        return _from_bytes(payload)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Broadcast a CPU tensor from trainer rank 0 over the push group (in place on the others);
        `what` names it in an error."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if self.split.rank == 0:
            peers = list(range(self.split.trainers, self.split.world_size))
            wait = f"for {self.names(peers)} to take {what}"
        else:
            peers, wait = [0], f"for {what} from trainer rank 0"
        self._run(lambda: self.push_pg.broadcast([tensor], opts), peers, None, wait)

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
    status = dist.PrefixStore("rollout_status", _store(rank, datetime.timedelta(seconds=STATUS_READ_S), client=True))
    return split, Bridge(split, store, timeout_s, status)
