"""The `sglang` rollout engine: an in-process SGLang `Engine` behind the `RolloutEngine` interface.

GPU only, optional extra (`pip install -r requirements-gpu.txt`). Nothing here imports SGLang at
module import time; `SGLangEngine(...)` does, on every rank (non-owners serialize their share of
each weight push with SGLang's helpers; only owners build an engine). Checked against the
source of the pinned wheel (tests/integration/test_sglang_adapter.py) and a recording fake; it has NOT been run
on a real SGLang install in this project (see docs/gpu.md).

Layout. Ranks are split into rollout TP groups of `tp_size` consecutive ranks on one node
(`rollout_group`). The first rank of a group owns one `sglang.Engine(tp_size=...)` spanning the
group's GPUs (`base_gpu_id` = its local rank); the other ranks ("feeders") own nothing and send
their prompts to the owner over a local TCP connection (JSON lines, port shared once through a
gloo group of the TP group) and get token ids, log-probs and finish reasons back. With
`tp_size=1` every rank owns an engine and nothing is forwarded.

Event loop. SGLang's `Engine` binds to one asyncio loop (`engine.loop`): `async_generate` must be
awaited on it and its synchronous methods (weight update, flush, release/resume) call
`engine.loop.run_until_complete`. The owner therefore runs that loop in a background thread while
requests are served (its own rollout coroutines, which run on another loop, and its feeders') and
stops the thread before any synchronous call. The thread keeps serving feeders while the owner's
main thread waits in training collectives.

Weight push (`update_weights`, all ranks of all groups, same order): each full tensor (DTensors are
gathered with `full_tensor()`, a collective) is cast to the engine dtype and put into a
dtype-grouped bucket of at most `bucket_size_mb`. Every rank of a group flattens the bucket on its
own GPU with SGLang's `FlattenedTensorBucket` and serializes it (CUDA IPC handles); the owner
gathers one payload per TP rank and calls `update_weights_from_tensor(payloads,
load_format="flattened_bucket", flush_cache=False)`: SGLang TP rank i maps the tensor on GPU i.
The owner broadcasts the outcome, which also keeps the feeders' buckets alive until loaded.
Sequence on the owner: group barrier (every rank done generating) -> drain in-flight requests ->
resume weights memory if released -> `begin_weight_update` -> buckets -> `end_weight_update` ->
one `flush_cache` -> resume KV cache / CUDA graph memory.

LoRA (`lora=LoraSettings`, the actor's `actor.lora.*`): the engine starts with `enable_lora` and the
adapters' rank and target modules; a push sends the adapters only. The owner loads them as a new
named adapter (`load_lora_adapter_from_tensors`, peft's tensor names and config), unloads the
previous one, flushes the cache (no prefix computed under older adapters is served), and every
later request names the new adapter (`lora_path`). Before the first push requests run on the base.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import torch

from train.engines.base import FinishReason, Generation, SamplingParams
from train.engines.weight_buckets import MB, Bucket, iter_buckets

# Memory regions `release_memory_occupation` frees (sglang/srt/constants.py). Weights come back
# first, before the push; the rest after it, so the push never competes with the KV cache.
WEIGHTS_TAG = "weights"
OTHER_TAGS = ("kv_cache", "cuda_graph")
ALL_TAGS = (WEIGHTS_TAG, *OTHER_TAGS)

_LINE_LIMIT = 1 << 26  # bytes per JSON line between feeder and owner (long prompts)


# ---------------------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class RolloutGroup:
    """This rank's rollout TP group: `members` are global ranks, the first one owns the engine."""

    rank: int
    members: tuple[int, ...]

    @property
    def owner(self) -> int:
        return self.members[0]

    @property
    def is_owner(self) -> bool:
        return self.rank == self.owner

    @property
    def tp_rank(self) -> int:
        return self.members.index(self.rank)

    @property
    def size(self) -> int:
        return len(self.members)


def rollout_groups(world_size: int, tp_size: int, local_world_size: int) -> list[tuple[int, ...]]:
    """All rollout TP groups: consecutive ranks, each group inside one node (an in-process SGLang
    engine spans the GPUs of one machine; torchrun numbers ranks node by node)."""
    if tp_size < 1:
        raise ValueError(f"rollout.tp_size must be >= 1, got {tp_size}")
    if world_size % tp_size:
        raise ValueError(f"rollout.tp_size={tp_size} must divide the number of ranks ({world_size})")
    if local_world_size % tp_size:
        raise ValueError(
            f"rollout.tp_size={tp_size} must divide the ranks per node ({local_world_size}): "
            "a rollout TP group must lie inside one node"
        )
    return [tuple(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]


def rollout_group(rank: int, world_size: int, tp_size: int, local_world_size: int) -> RolloutGroup:
    for members in rollout_groups(world_size, tp_size, local_world_size):
        if rank in members:
            return RolloutGroup(rank, members)
    raise ValueError(f"rank {rank} is not in [0, {world_size})")


def prepare_env(environ: MutableMapping[str, str]) -> None:
    """Environment SGLang needs when it is started inside a torchrun worker: its scheduler
    processes must not rendezvous through torchelastic's agent store, and non-zero ranks' children
    must not be blocked."""
    environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"


def engine_init_kwargs(
    model_path: str,
    *,
    tp_size: int,
    gpu_memory_utilization: float,
    port: int,
    base_gpu_id: int,
    dtype: str,
    seed: int,
    offload_weights: bool = False,
    extra: Mapping[str, Any] | None = None,
    lora: Any = None,
) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine(...)` (fields of SGLang's `ServerArgs`); `lora`
    (LoraSettings): room for one adapter of its rank on its target modules."""
    kwargs: dict[str, Any] = {
        "model_path": model_path,
        "tp_size": tp_size,
        "mem_fraction_static": gpu_memory_utilization,
        "enable_memory_saver": True,  # release_memory_occupation() needs it
        "port": port,
        "base_gpu_id": base_gpu_id,
        "dtype": dtype,
        "random_seed": seed,
    }
    if offload_weights:
        # Released weights are otherwise discarded: a wake() without a push in between (skipped or
        # frozen steps) would then generate from garbage. The CPU backup makes any resume correct.
        kwargs["enable_weights_cpu_backup"] = True
    if lora is not None:
        kwargs.update(enable_lora=True, max_lora_rank=lora.rank, lora_target_modules=list(lora.target_modules),
                      max_loras_per_batch=1)
    kwargs.update(extra or {})
    return kwargs


# ---------------------------------------------------------------------------------------- requests


# SGLang-only sampling parameters passed through from the config (`SamplingParams.extra`): fields of
# sglang.srt.sampling.sampling_params.SamplingParams (tests/integration/test_sglang_adapter.py checks them
# against the pinned wheel). Left out: `n` (data.responses_per_prompt), beam search, streaming,
# text-only options the adapter sets itself, and SGLang's internal fields.
SGLANG_SAMPLING_KEYS = ("min_new_tokens", "stop_regex", "json_schema", "regex", "ebnf", "structural_tag",
                        "logit_bias", "custom_params", "sampling_seed")


def image_data_of(prompt_ids: list[int], images: tuple) -> list[dict]:
    """A request's pictures in SGLang's "processor_output" image data: one dict for all of them, as a
    Hugging Face processor returns it (pixel_values of every image's patches, image_grid_thw one row per
    image, and the input_ids whose placeholder runs they fill). `prompt_ids` already holds every image's
    placeholder tokens (train/datasets/vision.py), so SGLang runs the tower on these pixels at these
    positions instead of processing images itself: what the trainer recomputes."""
    return [{"format": "processor_output", "input_ids": torch.tensor([prompt_ids], dtype=torch.long),
             "pixel_values": torch.cat([im.pixel_values for im in images]),
             "image_grid_thw": torch.stack([im.grid for im in images])}]


def to_sglang_sampling(sp: SamplingParams) -> dict[str, Any]:
    """Our sampling parameters as SGLang's `sampling_params` dict. Temperature 0 is greedy in both.
    `sp.seed` is not passed: SGLang only honours per-request seeds under deterministic inference
    (`sampling_seed` in the config passes one through anyway)."""
    params: dict[str, Any] = {
        "max_new_tokens": sp.max_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "min_p": sp.min_p,
        "repetition_penalty": sp.repetition_penalty,
        "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty,
        "ignore_eos": sp.ignore_eos,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # affects only SGLang's text; we use token ids
    }
    if sp.stop:
        params["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        params["stop_token_ids"] = list(sp.stop_token_ids)
    params.update(dict(sp.extra))
    return params


_FINISH_TYPES: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def to_generation(out: Mapping[str, Any], max_new_tokens: int, prompt_tokens: int) -> Generation:
    """SGLang's result dict -> Generation. Token ids come from `output_token_logprobs`
    (`(logprob, token_id, text)` triples), so ids and log-probs always line up; the response is cut
    to `max_new_tokens` tokens (then the finish reason is `length`)."""
    meta = out.get("meta_info") or {}
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise RuntimeError("SGLang returned no output_token_logprobs: was return_logprob=True passed?")
    token_ids = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    raw = meta.get("finish_reason")
    kind = raw.get("type") if isinstance(raw, Mapping) else raw
    reason: FinishReason = _FINISH_TYPES.get(str(kind), "abort") if kind is not None else "abort"
    if len(token_ids) > max_new_tokens:
        token_ids, logprobs, reason = token_ids[:max_new_tokens], logprobs[:max_new_tokens], "length"
    extra: dict[str, Any] = {"prompt_tokens": prompt_tokens}
    if isinstance(raw, Mapping) and raw.get("type") == "abort":
        extra["abort_message"] = raw.get("message")
    if "cached_tokens" in meta:
        extra["cached_tokens"] = meta["cached_tokens"]
    return Generation(token_ids, logprobs, reason, extra)


def _generation_to_json(gen: Generation) -> dict[str, Any]:
    return {"token_ids": gen.token_ids, "logprobs": gen.logprobs, "finish_reason": gen.finish_reason,
            "extra": gen.extra}


def _sampling_from_json(d: Mapping[str, Any]) -> SamplingParams:
    d = dict(d)
    for key in ("stop", "stop_token_ids"):
        d[key] = tuple(d.get(key) or ())
    d["extra"] = tuple((k, v) for k, v in d.get("extra") or ())
    return SamplingParams(**d)


# ---------------------------------------------------------------------------------------- bindings


@dataclass(frozen=True)
class SGLangBindings:
    """The SGLang entry points the adapter uses. `load_sglang()` gives the real ones; tests pass a
    recording fake (tests/fake_sglang.py)."""

    engine_factory: Callable[..., Any]  # sglang.srt.entrypoints.engine.Engine
    make_bucket: Callable[[list[tuple[str, torch.Tensor]]], Any]  # -> {"flattened_tensor", "metadata"}
    serialize: Callable[[Any], Any]  # -> one per-TP-rank payload


def load_sglang() -> SGLangBindings:
    """Import SGLang (only here). Patches torch's CUDA tensor pickling the way SGLang expects, so
    an IPC handle names the GPU by UUID and TP rank i opens the tensor on its own GPU."""
    try:
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError as e:
        raise ImportError(
            "rollout.engine=sglang needs SGLang on a GPU machine: pip install -r requirements-gpu.txt "
            "(or use rollout.engine=hf, which runs everywhere)"
        ) from e
    monkey_patch_torch_reductions()

    def make_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        bucket = FlattenedTensorBucket(named_tensors=named)
        return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}

    def serialize(obj: Any) -> str:
        return MultiprocessingSerializer.serialize(obj, output_str=True)

    return SGLangBindings(Engine, make_bucket, serialize)


# ---------------------------------------------------------------------------------------- helpers


class _LoopThread:
    """Runs an event loop in a daemon thread on demand; `pause()` stops and joins it so the loop's
    owner may call `loop.run_until_complete` again. Tasks on the loop survive a pause."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> Future:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sglang-loop", daemon=True)
                self._thread.start()
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def pause(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None and thread.is_alive():
                self.loop.call_soon_threadsafe(self.loop.stop)
                thread.join()


class _GroupComm:
    """Object collectives inside one rollout TP group (a gloo group: payloads are small)."""

    def __init__(self, group: RolloutGroup, process_group: Any) -> None:
        self.group, self.pg = group, process_group

    def barrier(self) -> None:
        if self.group.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.pg)

    def gather(self, obj: Any) -> list[Any] | None:
        if self.group.size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.group.size if self.group.is_owner else None
        dist.gather_object(obj, out, dst=self.group.owner, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.group.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.group.owner, group=self.pg)
        return box[0]


def _new_tp_process_group(groups: list[tuple[int, ...]], mine: tuple[int, ...]) -> Any:
    """Every rank must create every group, in the same order (torch.distributed rule)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("rollout.tp_size > 1 needs torch.distributed (launch with torchrun)")
    pg = None
    for members in groups:
        created = dist.new_group(list(members), backend="gloo")
        if members == mine:
            pg = created
    return pg


def _check(result: Any, what: str) -> None:
    """SGLang answers `(success, message)`, an object with `.success`, or None."""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        ok, message = result[0], (result[1] if len(result) > 1 else "")
    elif hasattr(result, "success"):  # LoRA updates answer LoRAUpdateOutput(success, error_message)
        ok, message = bool(result.success), getattr(result, "message", None) or getattr(result, "error_message", "")
    else:
        return
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


class _Client:
    """A feeder's connection to its owner, bound to the event loop that created it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> None:
        self.loop, self.host, self.port = loop, host, port
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Task | None = None
        self._reader_task: asyncio.Task | None = None

    async def _connect(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=_LINE_LIMIT)
        self._writer = writer
        self._reader_task = self.loop.create_task(self._read(reader), name="sglang-feeder-reader")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                fut = self._pending.pop(msg["id"], None)
                if fut is None or fut.done():
                    continue
                if "error" in msg:
                    fut.set_exception(RuntimeError(f"rollout owner rank failed this request: {msg['error']}"))
                else:
                    fut.set_result(Generation(msg["token_ids"], msg["logprobs"], msg["finish_reason"],
                                              msg.get("extra") or {}))
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("connection to the rollout owner rank closed"))
            self._pending.clear()

    async def request(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        if self._writer is None:
            if self._connecting is None:
                self._connecting = self.loop.create_task(self._connect())
            await asyncio.shield(self._connecting)
        if self._reader_task is not None and self._reader_task.done():
            raise ConnectionError("connection to the rollout owner rank closed")
        rid = next(self._ids)
        fut = self.loop.create_future()
        self._pending[rid] = fut
        line = json.dumps({"id": rid, "prompt_ids": prompt_ids, "sampling": asdict(sampling)}) + "\n"
        self._writer.write(line.encode())
        await self._writer.drain()
        return await fut

    def close(self) -> None:
        if self._writer is not None and not self.loop.is_closed():
            self._writer.close()
        self._writer = None


# ---------------------------------------------------------------------------------------- engine


class SGLangEngine:
    """See the module docstring. `stats`: `requests`, `generated_tokens`, `generation_seconds` (this
    rank's own requests, owner or feeder), `pushes`, `buckets`, `pushed_bytes`, `push_seconds`."""

    def __init__(
        self,
        model_path: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        local_world_size: int = 1,
        tp_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        base_port: int = 30000,
        bucket_size_mb: float = 512,
        dtype: str = "bfloat16",
        seed: int = 0,
        offload_weights: bool = False,
        device: str | torch.device | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        bindings: SGLangBindings | None = None,
        process_group: Any = None,
        drain_timeout_s: float = 600.0,
        lora: Any = None,
    ) -> None:
        """`process_group`: the gloo group of this rank's TP group; created here (collectively, on
        every rank) when None and `tp_size > 1`. `engine_kwargs`: extra `ServerArgs` fields.
        `offload_weights`: `sleep()` also releases the weights (SGLang keeps a CPU backup), not
        only the KV cache and CUDA graphs."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if bucket_size_mb <= 0:
            raise ValueError(f"rollout.bucket_size_mb must be > 0, got {bucket_size_mb}")
        if dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"rollout.dtype for sglang must be bfloat16, float16 or float32, got {dtype!r}")
        groups = rollout_groups(world_size, tp_size, local_world_size)
        self.group = rollout_group(rank, world_size, tp_size, local_world_size)
        if tp_size > 1 and process_group is None:
            process_group = _new_tp_process_group(groups, self.group.members)
        self._comm = _GroupComm(self.group, process_group)
        self._bindings = bindings if bindings is not None else load_sglang()
        self.dtype = getattr(torch, dtype)  # pushed floating-point tensors are cast to it
        if device is None:
            device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.bucket_bytes = int(bucket_size_mb * MB)
        self.drain_timeout_s = drain_timeout_s
        self.weight_version = 0  # set by the trainer after each push (train/trainer/policy_sync.py)
        self.stats: dict[str, float] = {"requests": 0, "generated_tokens": 0, "generation_seconds": 0.0,
                                        "pushes": 0, "buckets": 0, "pushed_bytes": 0, "push_seconds": 0.0}
        self._mine_inflight = 0  # this rank's requests in flight (its own event loop)
        self._busy_since = 0.0
        self._released: set[str] = set()
        self._sleep_tags = ALL_TAGS if offload_weights else OTHER_TAGS
        self._engine: Any = None
        self._loop_thread: _LoopThread | None = None
        self._inflight = 0  # touched only on the engine loop
        self._idle: asyncio.Event | None = None
        self._server: asyncio.AbstractServer | None = None
        self._client: _Client | None = None
        self._owner_port: int | None = None
        # LoRA: pushes load adapters (named policy-<push>) instead of weights; requests name the newest.
        self._lora = lora
        self._adapter: str | None = None

        if self.group.is_owner:
            prepare_env(os.environ)
            self._engine = self._bindings.engine_factory(**engine_init_kwargs(
                model_path, tp_size=tp_size, gpu_memory_utilization=gpu_memory_utilization,
                port=base_port + rank, base_gpu_id=local_rank, dtype=dtype, seed=seed,
                offload_weights=offload_weights, extra=engine_kwargs, lora=lora))
            loop = getattr(self._engine, "loop", None) or asyncio.new_event_loop()
            self._loop_thread = _LoopThread(loop)
            if self.group.size > 1:
                self._server = self._loop_thread.submit(self._start_server()).result()
                self._owner_port = self._server.sockets[0].getsockname()[1]
        # Feeders learn where their owner listens (one collective, at start-up).
        self._owner_port = self._comm.broadcast(self._owner_port)

    # ------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, images: Any = ()) -> Generation:
        """One response. This rank's `stats` count its own requests (the owner also serves its
        feeders', which they count): tokens, and the time any of them was in flight. `images` (a
        vision-language model): the prompt's ImageInputs in placeholder order, passed as SGLang's
        "processor_output" image data (`image_data_of`)."""
        prompt_ids = [int(t) for t in prompt_ids]
        images = tuple(images)
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        if images and not self.group.is_owner:
            raise ValueError("generate: images with rollout.tp_size > 1 are not forwarded to the owner rank yet; "
                             "use rollout.tp_size=1 for a vision-language model")
        if self._mine_inflight == 0:
            self._busy_since = time.perf_counter()
        self._mine_inflight += 1
        try:
            if self.group.is_owner:
                assert self._loop_thread is not None
                future = self._loop_thread.submit(self._generate_on_engine(prompt_ids, sampling, images))
                gen = await asyncio.wrap_future(future)
            else:
                gen = await self._client_for_loop().request(prompt_ids, sampling)
        finally:
            self._mine_inflight -= 1
            if self._mine_inflight == 0:
                self.stats["generation_seconds"] += time.perf_counter() - self._busy_since
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(gen.token_ids)
        return gen

    async def _generate_on_engine(self, prompt_ids: list[int], sampling: SamplingParams,
                                  images: tuple = ()) -> Generation:
        """Runs on the engine loop."""
        if self._released:
            raise RuntimeError("the SGLang engine is asleep: call wake() or update_weights() on every rank "
                               "before generating again")
        if self._idle is None:
            self._idle = asyncio.Event()
        self._inflight += 1
        self._idle.clear()
        try:
            adapter = {"lora_path": self._adapter} if self._adapter is not None else {}
            if images:
                adapter["image_data"] = image_data_of(prompt_ids, images)
            out = await self._engine.async_generate(
                input_ids=prompt_ids, sampling_params=to_sglang_sampling(sampling), return_logprob=True, **adapter
            )
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        return to_generation(out, sampling.max_new_tokens, len(prompt_ids))

    async def _wait_idle(self) -> None:
        if self._inflight and self._idle is not None:
            await self._idle.wait()

    def _client_for_loop(self) -> _Client:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client.loop is not loop:
            assert self._owner_port is not None
            self._client = _Client(loop, "127.0.0.1", self._owner_port)
        return self._client

    async def _start_server(self) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=_LINE_LIMIT)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One feeder connection, on the engine loop: each request line runs as its own task so
        the feeder's requests are batched by SGLang like the owner's own."""
        tasks: set[asyncio.Task] = set()
        write_lock = asyncio.Lock()
        try:
            while line := await reader.readline():
                task = asyncio.ensure_future(self._answer(json.loads(line), writer, write_lock))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            writer.close()

    async def _answer(self, msg: Mapping[str, Any], writer: asyncio.StreamWriter, lock: asyncio.Lock) -> None:
        try:
            gen = await self._generate_on_engine([int(t) for t in msg["prompt_ids"]],
                                                 _sampling_from_json(msg["sampling"]))
            reply = {"id": msg["id"], **_generation_to_json(gen)}
        except Exception as exc:  # the feeder's caller sees it; the owner keeps serving
            reply = {"id": msg["id"], "error": f"{type(exc).__name__}: {exc}"}
        async with lock:
            writer.write((json.dumps(reply) + "\n").encode())
            await writer.drain()

    # ------------------------------------------------------------------ control (all ranks call these)

    def _quiesce(self) -> None:
        """Owner: wait for in-flight requests, then stop the loop thread so SGLang's synchronous
        methods can run the loop themselves."""
        assert self._loop_thread is not None
        try:
            self._loop_thread.submit(self._wait_idle()).result(timeout=self.drain_timeout_s)
        except TimeoutError as e:
            raise RuntimeError(f"SGLang requests still running after {self.drain_timeout_s}s; cannot "
                               "change weights or memory under them") from e
        self._loop_thread.pause()

    def sleep(self) -> None:
        """Free the engine's GPU memory for training: KV cache and CUDA graphs (and the weights with
        `offload_weights`). Every rank of the group calls it; the owner waits until all of them are
        done generating."""
        self._comm.barrier()
        if self.group.is_owner and not self._released:
            self._quiesce()
            self._engine.release_memory_occupation(tags=list(self._sleep_tags))
            self._released = set(self._sleep_tags)

    def wake(self) -> None:
        """Undo `sleep()`. A push wakes the engine too; generating while asleep is an error (the
        trainer calls wake() before each rollout on every rank)."""
        if self.group.is_owner and self._released:
            self._quiesce()
            self._engine.resume_memory_occupation(tags=[t for t in ALL_TAGS if t in self._released])
            self._released.clear()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Push full weights (state_dict names); collective over all ranks. See the module docstring."""
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        if self._lora is not None:
            return self._push_adapters(named_tensors)
        start = time.perf_counter()
        self._comm.barrier()  # every rank of the group has finished generating
        error = None
        if self.group.is_owner:
            try:
                self._quiesce()
                if WEIGHTS_TAG in self._released:
                    self._engine.resume_memory_occupation(tags=[WEIGHTS_TAG])
                    self._released.discard(WEIGHTS_TAG)
                begin = getattr(self._engine, "begin_weight_update", None)
                if begin is not None:  # SGLang >= 0.5.2x: loads happen inside a session
                    _check(begin(), "begin_weight_update")
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        self._raise_if(self._comm.broadcast(error))

        for bucket in iter_buckets(self._prepared(named_tensors), self.bucket_bytes):
            self._push_bucket(bucket)

        error = None
        if self.group.is_owner:
            try:
                end = getattr(self._engine, "end_weight_update", None)
                if end is not None:
                    _check(end(), "end_weight_update")
                _check(self._engine.flush_cache(), "flush_cache")  # once, after the last bucket
                rest = [t for t in OTHER_TAGS if t in self._released]
                if rest:
                    self._engine.resume_memory_occupation(tags=rest)
                    self._released.difference_update(rest)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        self._raise_if(self._comm.broadcast(error))
        self.stats["pushes"] += 1
        self.stats["push_seconds"] += time.perf_counter() - start

    def _push_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LoRA: the adapters (a few MB) as one new named adapter; see the module docstring."""
        from train.models.lora import peft_key

        start = time.perf_counter()
        tensors = {peft_key(name): tensor for name, tensor in self._prepared(named_tensors)}
        self._comm.barrier()  # every rank of the group has finished generating
        error = None
        if self.group.is_owner:
            try:
                self._quiesce()
                if self._released:  # asleep: the adapters go into the weights' and cache's memory
                    self._engine.resume_memory_occupation(tags=[t for t in ALL_TAGS if t in self._released])
                    self._released.clear()
                name = f"policy-{int(self.stats['pushes']) + 1}"
                config = self._lora.peft_config().to_dict()
                config["target_modules"] = sorted(config["target_modules"])  # a set in peft's config
                _check(self._engine.load_lora_adapter_from_tensors(lora_name=name, tensors=tensors,
                                                                   config_dict=config),
                       "load_lora_adapter_from_tensors")
                if self._adapter is not None:
                    _check(self._engine.unload_lora_adapter(lora_name=self._adapter), "unload_lora_adapter")
                self._adapter = name
                _check(self._engine.flush_cache(), "flush_cache")  # no prefix of the old adapter served
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        self._raise_if(self._comm.broadcast(error))
        self.stats["pushes"] += 1
        self.stats["pushed_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        self.stats["push_seconds"] += time.perf_counter() - start

    def _prepared(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in named_tensors:
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()  # a collective: every rank iterates the same names
            tensor = tensor.detach()
            dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
            yield name, tensor.to(device=self.device, dtype=dtype)

    def _push_bucket(self, bucket: Bucket) -> None:
        payload = self._bindings.serialize(self._bindings.make_bucket(bucket.named_tensors))
        payloads = self._comm.gather(payload)  # one per TP rank, TP rank order
        error = None
        if self.group.is_owner:
            try:
                _check(self._engine.update_weights_from_tensor(
                    named_tensors=payloads, load_format="flattened_bucket", flush_cache=False),
                    "update_weights_from_tensor")
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        # Also keeps every rank's bucket (shared through CUDA IPC) alive until the owner loaded it.
        self._raise_if(self._comm.broadcast(error))
        self.stats["buckets"] += 1
        self.stats["pushed_bytes"] += bucket.nbytes

    def _raise_if(self, error: str | None) -> None:
        if error is not None:
            raise RuntimeError(f"SGLang weight push failed on rank {self.group.owner} (rollout owner): {error}")

    def close(self) -> None:
        """Shut the engine down (owner) or drop the connection (feeder)."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._engine is None:
            return
        assert self._loop_thread is not None
        self._loop_thread.pause()
        if self._server is not None:
            self._server.close()
            self._server = None
        engine, self._engine = self._engine, None
        engine.shutdown()
