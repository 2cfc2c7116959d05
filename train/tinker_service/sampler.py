"""Sampling for Tinker's sampling clients: the project's `hf` engine, one per kind of weights, on rank 0.

A sampler is a snapshot of a trained model's weights (`save_weights_for_sampler`), or the base model. Engines
are shared: one per base model for base sampling, one per (base model, LoRA shape) whose adapter tensors are
swapped in before a batch of the snapshot they belong to, and one per base model for fully fine-tuned
snapshots. So memory grows with the adapters held (a few MB each), not with the samplers. Requests of one
snapshot run together (the engine batches concurrent requests); a request for another snapshot waits until the
engine's running requests finish, then its weights are written in.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from train.engines.base import SamplingParams
from train.engines.hf import HFEngine
from train.models.lora import LoraSettings
from train.tinker_service.errors import ClientError
from train.tinker_service.wire import Sequence


@dataclass(frozen=True)
class Snapshot:
    """The weights a sampler samples with: `tensors` None means the base model's own."""
    snapshot_id: str
    base_path: str
    lora: LoraSettings | None = None
    tensors: dict[str, torch.Tensor] | None = None
    base_model: str = ""  # the name the client gave the base model (what get_sampler reports)

    @property
    def engine_key(self) -> tuple:
        if self.tensors is None:
            return (self.base_path, "base")
        if self.lora is None:
            return (self.base_path, "full")
        return (self.base_path, self.lora.rank, self.lora.target_modules)


class _EngineSlot:
    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.holds: str | None = None  # the snapshot whose weights are in the engine
        self.running = 0
        self.changed = asyncio.Condition()
        self.wave: asyncio.Event | None = None  # requests gathering to go to the engine together
        self.last_arrival = 0.0


class SamplerPool:
    def __init__(self, device: torch.device, max_batch_size: int = 256, gather_s: float = 0.01,
                 max_gather_s: float = 0.1) -> None:
        """Requests sent together (the cookbook sends one per sample, and they reach the server over tens of
        milliseconds) go to the engine as one batch: the first waits until no request came for `gather_s`
        (at most `max_gather_s`), then releases them all at once; 0 sends each at once."""
        self.device, self.max_batch_size = device, max_batch_size
        self.gather_s, self.max_gather_s = gather_s, max_gather_s
        self._slots: dict[tuple, _EngineSlot] = {}

    def _slot(self, snap: Snapshot) -> _EngineSlot:
        slot = self._slots.get(snap.engine_key)
        if slot is None:
            lora = snap.lora if snap.tensors is not None else None
            engine = HFEngine.from_pretrained(snap.base_path, device=self.device, lora=lora,
                                              max_batch_size=self.max_batch_size)
            slot = self._slots[snap.engine_key] = _EngineSlot(engine)
        return slot

    async def sample(self, snap: Snapshot, prompt: list[int], num_samples: int, params: dict[str, Any],
                     prompt_logprobs: bool = False, last_n: int | None = None) -> tuple[list[Sequence], list | None]:
        slot = self._slot(snap)
        sampling = self._sampling_params(slot.engine, prompt, params)
        async with slot.changed:
            await slot.changed.wait_for(lambda: slot.holds == snap.snapshot_id or slot.running == 0)
            if slot.holds != snap.snapshot_id:
                if snap.tensors is not None:
                    await asyncio.to_thread(slot.engine.update_weights, snap.tensors)
                slot.holds = snap.snapshot_id
            slot.running += 1
        try:
            await self._gathered(slot)
            seeds = [None if sampling.seed is None else sampling.seed + i for i in range(num_samples)]
            gens = await asyncio.gather(*(slot.engine.generate(prompt, replace(sampling, seed=s)) for s in seeds))
            scored = None
            if prompt_logprobs:
                scored = [math.nan] * len(prompt)
                if len(prompt) > 1:
                    values = (await asyncio.to_thread(slot.engine.score, prompt)).tolist()
                    first = 1 if last_n is None else max(1, len(prompt) - last_n)
                    scored[first:] = values[first - 1:]
        finally:
            async with slot.changed:
                slot.running -= 1
                slot.changed.notify_all()
        return [Sequence(g.token_ids, g.logprobs, g.finish_reason != "length") for g in gens], scored

    async def _gathered(self, slot: _EngineSlot) -> None:
        if self.gather_s <= 0:
            return
        loop = asyncio.get_running_loop()
        slot.last_arrival = loop.time()
        if slot.wave is not None:  # a wave is gathering: go with it
            await slot.wave.wait()
            return
        wave = slot.wave = asyncio.Event()
        start = loop.time()
        while (quiet := slot.last_arrival + self.gather_s - loop.time()) > 0:
            if loop.time() - start >= self.max_gather_s:
                break
            await asyncio.sleep(quiet)
        slot.wave = None
        wave.set()  # every waiter calls generate before the engine's loop next runs: one batch

    @staticmethod
    def _sampling_params(engine: HFEngine, prompt: list[int], params: dict[str, Any]) -> SamplingParams:
        """The SDK's SamplingParams as the engine's. `stop`: a string or strings end the response when decoded;
        token ids end it when sampled; [] disables EOS too; None keeps EOS."""
        stop = params.get("stop")
        strings: tuple[str, ...] = ()
        token_ids: tuple[int, ...] = ()
        if isinstance(stop, str):
            strings = (stop,)
        elif stop:
            if all(isinstance(s, str) for s in stop):
                strings = tuple(stop)
            elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
                token_ids = tuple(stop)
            else:
                raise ClientError("sampling_params.stop: give strings or token ids, not both")
        room = (engine.max_positions or 1 << 30) - len(prompt)
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            max_tokens = room
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ClientError(f"sampling_params.max_tokens must be >= 1, got {max_tokens!r}")
        if max_tokens > room:
            raise ClientError(f"sampling_params.max_tokens={max_tokens} with a {len(prompt)}-token prompt "
                                     f"exceeds the model's context of {engine.max_positions}")
        top_k = params.get("top_k", -1)
        return SamplingParams(max_new_tokens=max_tokens, temperature=float(params.get("temperature", 1.0)),
                              top_p=float(params.get("top_p", 1.0)), top_k=-1 if top_k in (None, 0) else int(top_k),
                              stop=strings, stop_token_ids=token_ids, ignore_eos=stop == [],
                              seed=params.get("seed"))

    def close(self) -> None:
        for slot in self._slots.values():
            slot.engine.close()

