"""Every rank runs the same model operations in the same order: rank 0 (which serves HTTP) broadcasts each one.

The operations run on one compute thread on rank 0, so at most one model step is in flight on the ranks at a
time; each operation's arguments travel once to every rank (`broadcast_object_list`, over a gloo group so it
works the same on CPU and GPU), its result comes back from rank 0's own run. Idle ranks wait in the broadcast;
rank 0 sends a no-op every `heartbeat_s` so their wait never reaches the process group's timeout.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist

from train.tinker_service.errors import ClientError
from train.tinker_service.trainee import AdamStep, TrainedModel, load_base, lora_of


class Operations:
    """The model operations, by name; the same object on every rank, keyed by model id."""

    def __init__(self, device, mesh, micro_batch_tokens: int = 16384) -> None:
        self.device, self.mesh, self.micro_batch_tokens = device, mesh, micro_batch_tokens
        self.models: dict[str, TrainedModel] = {}
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.bases: dict[str, torch.nn.Module] = {}  # base models LoRA models share (one rank: see create)

    def model(self, model_id: str) -> TrainedModel:
        found = self.models.get(model_id)
        if found is None:
            raise ClientError(f"model {model_id!r} is not loaded here (unloaded, or the service restarted)")
        return found

    def create(self, model_id: str, base_path: str, lora: dict | None, seed: int) -> None:
        settings = lora_of(lora)
        shared = None
        if settings is not None and self.world == 1:  # under FSDP every model shards its own parameters
            if base_path not in self.bases:
                self.bases[base_path] = load_base(base_path, self.device).requires_grad_(False)
            shared = self.bases[base_path]
        self.models[model_id] = TrainedModel(base_path, settings, seed, self.device, self.mesh, shared=shared,
                                             micro_batch_tokens=self.micro_batch_tokens)

    def forward_backward(self, model_id: str, data, loss_fn: str, config: dict, forward_only: bool):
        return self.model(model_id).forward_backward(data, loss_fn, config, forward_only)

    def optim_step(self, model_id: str, step: dict) -> dict[str, float]:
        return self.model(model_id).optim_step(AdamStep(**step))

    def save(self, model_id: str, folder: str) -> None:
        self.model(model_id).save(folder)

    def load(self, model_id: str, folder: str, with_optimizer: bool) -> None:
        self.model(model_id).load(folder, with_optimizer)

    def sampler_weights(self, model_id: str):
        return self.model(model_id).sampler_weights()

    def unload(self, model_id: str) -> None:
        self.models.pop(model_id, None)

    def noop(self) -> None:
        return None


class RankGroup:
    """Rank 0's handle: `submit(name, **kwargs)` runs `Operations.<name>` on every rank, on the compute thread."""

    def __init__(self, ops: Operations, heartbeat_s: float = 60.0) -> None:
        self.ops = ops
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._group = dist.new_group(backend="gloo") if self.world > 1 else None
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-compute")
        self._last = time.monotonic()
        self._stopping = threading.Event()
        self._heartbeat_s = heartbeat_s
        if self.world > 1:
            threading.Thread(target=self._heartbeat, daemon=True, name="tinker-heartbeat").start()

    def submit(self, name: str, **kwargs: Any) -> Future:
        return self._compute.submit(self._run, name, kwargs)

    def _run(self, name: str, kwargs: dict) -> Any:
        self._last = time.monotonic()
        if self.world > 1:
            dist.broadcast_object_list([(name, kwargs)], src=0, group=self._group)
        return getattr(self.ops, name)(**kwargs)

    def _heartbeat(self) -> None:
        while not self._stopping.wait(self._heartbeat_s / 4):
            if time.monotonic() - self._last > self._heartbeat_s:
                self.submit("noop").result()

    def close(self) -> None:
        self._stopping.set()
        if self.world > 1:
            self._compute.submit(lambda: dist.broadcast_object_list([("stop", {})], src=0, group=self._group)).result()
        self._compute.shutdown(wait=True)


def follow(ops: Operations) -> None:
    """Ranks other than 0: run what rank 0 broadcasts until it says stop. An operation's error is rank 0's
    to report (every rank hits the same one on the same input); here it is only logged."""
    group = dist.new_group(backend="gloo")
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        name, kwargs = box[0]
        if name == "stop":
            return
        run: Callable = getattr(ops, name)
        try:
            run(**kwargs)
        except Exception as e:  # noqa: BLE001 - rank 0 fails the request; this rank stays in step
            print(f"[tinker_service rank {dist.get_rank()}] {name} failed: {e}", flush=True)
