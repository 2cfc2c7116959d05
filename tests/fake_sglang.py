"""A RECORDING FAKE of `sglang.Engine` for the adapter tests. It is not SGLang and runs no model.

It records every call (method name and keyword arguments, so tests/integration/test_sglang_adapter.py can
check them against the real wheel's signatures) and enforces the rules of the real engine that the
adapter relies on (read from SGLang 0.5.23's source):
- `async_generate` must run on `engine.loop`; the synchronous methods call
  `self.loop.run_until_complete` (so they fail while that loop runs in another thread);
- `update_weights_from_tensor` only inside `begin_weight_update()` / `end_weight_update()`;
  `load_format="flattened_bucket"` takes one serialized payload per TP rank;
- releasing memory and flushing the cache need an idle engine; resuming a tag that is not
  released is an error; generating with released weights is an error.
Output tokens are a deterministic function of (prompt, weights version), so tests can tell which
weights served a request.
"""
from __future__ import annotations

import asyncio
import pickle
import threading
from dataclasses import dataclass
from typing import Any

import torch

from train.engines.sglang import SGLangBindings

EOS = 1
VOCAB = 50


@dataclass
class FlushResult:
    success: bool
    message: str = ""


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Stand-in for SGLang's FlattenedTensorBucket: one uint8 buffer plus per-tensor metadata."""
    parts, meta, offset = [], [], 0
    for name, t in named:
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        parts.append(flat)
        meta.append((name, t.dtype, tuple(t.shape), offset, offset + flat.numel()))
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": meta}


def unflatten_bucket(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    buf = payload["flattened_tensor"]
    return {name: buf[a:b].view(dtype).reshape(shape).clone() for name, dtype, shape, a, b in payload["metadata"]}


@dataclass
class LoraResult:  # like SGLang's LoadLoRAAdapterReqOutput
    success: bool
    error_message: str


class RecordingFakeSGLangEngine:
    """See the module docstring. `calls` is shared with the test: (method, kwargs) tuples."""

    def __init__(self, *, calls: list, delay_s: float = 0.0, overshoot: int = 0, **kwargs: Any) -> None:
        self.calls = calls
        self.kwargs = kwargs
        self.tp_size = kwargs.get("tp_size", 1)
        self.delay_s = delay_s
        self.overshoot = overshoot  # extra tokens beyond max_new_tokens (to test trimming)
        self.loop = asyncio.new_event_loop()  # like sglang.Engine: the loop it was created with
        self.loaded: dict[str, torch.Tensor] = {}
        self.buckets: list[list[str]] = []
        self.bucket_dtypes: list[set[torch.dtype]] = []
        self.bucket_bytes: list[int] = []
        self.version = 0
        self.session = False
        self.released: set[str] = set()
        self.inflight = 0
        self.generated = threading.Event()
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}  # LoRA: name -> peft-named tensors
        self._record("__init__", kwargs)

    def _record(self, name: str, kwargs: dict) -> None:
        self.calls.append((name, dict(kwargs)))

    # -- generation ------------------------------------------------------------------------
    async def async_generate(self, input_ids=None, sampling_params=None, return_logprob=False, **kw):
        self._record("async_generate", dict(input_ids=input_ids, sampling_params=sampling_params,
                                            return_logprob=return_logprob, **kw))
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("fake SGLang: async_generate awaited outside engine.loop")
        if "weights" in self.released:
            raise RuntimeError("fake SGLang: generate with released weights")
        if kw.get("lora_path") is not None and kw["lora_path"] not in self.adapters:
            raise RuntimeError(f"fake SGLang: no adapter named {kw['lora_path']}")
        self.inflight += 1
        try:
            await asyncio.sleep(self.delay_s)
            sp = sampling_params or {}
            limit = sp.get("max_new_tokens", 128)
            tokens, reason = [], {"type": "length", "length": limit}
            for i in range(limit + self.overshoot):
                tok = (sum(input_ids) + 3 * i + self.version) % VOCAB
                tokens.append(tok)
                if tok == EOS:
                    reason = {"type": "stop", "matched": EOS}
                    break
            triples = [(-0.25 - 0.01 * i, t, None) for i, t in enumerate(tokens)]
            meta = {"finish_reason": reason, "prompt_tokens": len(input_ids), "completion_tokens": len(tokens)}
            if return_logprob:
                meta["output_token_logprobs"] = triples
            return {"text": "", "output_ids": list(tokens), "meta_info": meta}
        finally:
            self.inflight -= 1
            self.generated.set()

    # -- synchronous control, each through self.loop like the real engine -------------------
    def _sync(self, coro):
        return self.loop.run_until_complete(coro)

    def begin_weight_update(self, selector: str = "all"):
        self._record("begin_weight_update", dict(selector=selector))

        async def run():
            if self.session:
                return False, "a weight-update session is already open"
            self.session = True
            return True, "Success"

        return self._sync(run())

    def end_weight_update(self):
        self._record("end_weight_update", {})

        async def run():
            if not self.session:
                return False, "no weight-update session is open"
            self.session = False
            self.version += 1
            return True, "Success"

        return self._sync(run())

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._record("update_weights_from_tensor", dict(named_tensors=named_tensors, load_format=load_format,
                                                         flush_cache=flush_cache))

        async def run():
            if not self.session:
                return False, "update_weights_from_tensor must run between begin/end_weight_update()"
            if "weights" in self.released:
                return False, "weights are released"
            if load_format != "flattened_bucket" or len(named_tensors) != self.tp_size:
                return False, f"expected {self.tp_size} flattened_bucket payloads"
            per_rank = [unflatten_bucket(pickle.loads(p)) for p in named_tensors]
            for other in per_rank[1:]:  # every TP rank must see the same bucket
                if other.keys() != per_rank[0].keys() or any(not torch.equal(other[k], per_rank[0][k]) for k in other):
                    return False, "TP ranks sent different buckets"
            self.buckets.append(list(per_rank[0]))
            self.bucket_dtypes.append({t.dtype for t in per_rank[0].values()})
            self.bucket_bytes.append(sum(t.numel() * t.element_size() for t in per_rank[0].values()))
            self.loaded.update(per_rank[0])
            return True, "Success"

        return self._sync(run())

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None):
        self._record("load_lora_adapter_from_tensors", dict(lora_name=lora_name, tensors=tensors,
                                                             config_dict=config_dict, load_format=load_format))

        async def run():
            if lora_name in self.adapters:
                return LoraResult(False, f"adapter {lora_name} is already loaded")
            if not self.kwargs.get("enable_lora"):
                return LoraResult(False, "LoRA is not enabled (enable_lora)")
            if config_dict.get("r", 0) > self.kwargs.get("max_lora_rank", 0):
                return LoraResult(False, "rank above max_lora_rank")
            self.adapters[lora_name] = {k: v.clone() for k, v in tensors.items()}
            self.version += 1
            return LoraResult(True, "")

        return self._sync(run())

    def unload_lora_adapter(self, lora_name):
        self._record("unload_lora_adapter", dict(lora_name=lora_name))

        async def run():
            if self.adapters.pop(lora_name, None) is None:
                return LoraResult(False, f"no adapter {lora_name}")
            return LoraResult(True, "")

        return self._sync(run())

    def flush_cache(self):
        self._record("flush_cache", {})

        async def run():
            return FlushResult(self.inflight == 0, "requests are still running")

        return self._sync(run())

    def release_memory_occupation(self, tags=None):
        self._record("release_memory_occupation", dict(tags=tags))

        async def run():
            assert self.inflight == 0, "release_memory_occupation should be called only when server is idle."
            self.released.update(tags or ("kv_cache", "weights", "cuda_graph"))

        return self._sync(run())

    def resume_memory_occupation(self, tags=None):
        self._record("resume_memory_occupation", dict(tags=tags))

        async def run():
            for tag in tags or ("kv_cache", "weights", "cuda_graph"):
                self.released.remove(tag)  # KeyError for a tag that is not released, like SGLang

        return self._sync(run())

    def shutdown(self):
        self._record("shutdown", {})


def fake_bindings(calls: list, **engine_options: Any) -> tuple[SGLangBindings, list]:
    """Bindings whose engine factory builds a RecordingFakeSGLangEngine; returns (bindings, engines)."""
    engines: list[RecordingFakeSGLangEngine] = []

    def factory(**kwargs):
        engine = RecordingFakeSGLangEngine(calls=calls, **engine_options, **kwargs)
        engines.append(engine)
        return engine

    return SGLangBindings(factory, flatten_bucket, pickle.dumps), engines


def expected_tokens(prompt: list[int], max_new_tokens: int, version: int) -> list[int]:
    """What the fake generates, for checking results end to end."""
    out = []
    for i in range(max_new_tokens):
        tok = (sum(prompt) + 3 * i + version) % VOCAB
        out.append(tok)
        if tok == EOS:
            break
    return out
