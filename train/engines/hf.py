"""The `hf` rollout engine: transformers with a KV cache, many sequences per forward.

How it works:
- Every `generate` call (one coroutine per sample) puts its request into a per-event-loop queue.
  A background task takes everything queued (up to `max_batch_size`) as one batch; requests that
  arrive while that batch runs wait for the next one.
- The batch runs in a single-worker thread so the event loop (env calls, reward functions) keeps
  running while the model computes.
- Prefill is batched with left padding, an attention mask and explicit position ids, so a prompt
  gives the same tokens and log-probs whatever else shares its batch. Decoding uses a
  `DynamicCache`; rows that finish are removed from the cache and the batch at once, so they stop
  costing compute (plain `model.generate`, which TRL uses, keeps decoding finished rows).
- Log-probs are `log_softmax(logits / T)` of the sampled token under the full distribution, the
  same quantity the trainer recomputes from a full forward pass (no top-p/top-k renormalisation;
  greedy rows use T = 1). They are computed in float32.
- Sampling draws one uniform number per row and step and inverts the (filtered) CDF. A request
  with `seed` draws its uniforms from its own generator (all at once, at the start of its batch), so
  its sample depends only on (seed, model, prompt, sampling params) and not on the batch around it.

On CUDA (docs/gpu.md):
- `from_pretrained` loads bfloat16 weights by default (float32 on CPU); the worker thread selects
  the engine's GPU before every batch (the current CUDA device is per thread).
- `sleep()` moves the weights to one page-locked host slab of exactly their bytes (reused by every
  sleep; torch's pinned allocator would round each tensor up to a power of two); a push onto a
  sleeping engine writes each pushed tensor straight into new GPU storage (one device-to-device copy
  with the dtype cast), so pushed weights never travel back from the host; only tensors that were
  not pushed are uploaded at `wake()`.
- A pushed tensor that already is the engine's storage (an engine sharing its weights with the
  trainer: same device, dtype and memory) is not copied at all.
- Decoding runs over a preallocated KV cache with CUDA graphs (`static_cache`,
  train/engines/static_decode.py): an eager step is bound by Python launching its kernels. Rows
  are padded to power-of-two buckets and finished rows leave when the live ones fit a smaller one;
  the `DynamicCache` path (finished rows evicted at once) remains for CPU, for models with
  sliding-window or other special cache layers, and when not even one row's buffers fit (a batch
  larger than the buffers' memory limit is decoded in parts that fit).
- `stats["generated_tokens"] / stats["generation_seconds"]` is the decode throughput
  (`tokens_per_second()`); benchmarks/hf_engine_throughput.py measures it.
"""
from __future__ import annotations

import asyncio
import copy
import inspect
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from train.algorithms.logits import mask_unsampled
from train.engines.base import Generation, SamplingParams
from train.engines.sampling import Penalties, sample_tokens
from train.engines.static_decode import (CompiledLayers, StaticDecoder, column_bucket, compile_decode_modules,
                                         install_grouped_decode_attention, kv_bytes_per_token, row_bucket,
                                         supports_static_decode, uncompile_modules)
from train.models.config import compute_dtype
from train.models.memory_plan import free_device_bytes
from train.models.router_replay import RoutingRecorder
from train.models.vlm import (VisionSpec, image_spans, is_vision_config, model_class, mrope_positions,
                              text_config)
from train.utils.checksum import CHUNK_BYTES, Checksummer
from train.utils.host_slab import HostSlab
from train.utils.tensor_stream import grouped


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    images: tuple = ()  # ImageInputs of the prompt's placeholder runs, in order (a vision-language model)


@dataclass
class _LoopState:
    """Queue and batching task of one event loop (tests and scripts may run several loops in turn)."""

    loop: asyncio.AbstractEventLoop
    pending: list[_Request] = field(default_factory=list)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class _Routes:
    """The experts every row of a decoding batch was routed to (record_routing): the prefill's, then
    one column per decode step, kept on the device until the batch ends."""

    def __init__(self, recorder: RoutingRecorder, prefill_rows: int, width: int, rows: int, steps: int,
                 device: torch.device) -> None:
        self.recorder, self.spec = recorder, recorder.spec
        self.prefill = recorder.take().view(prefill_rows, width, self.spec.layers, self.spec.top_k)
        self.width = width
        self.decoded = torch.full((rows, steps, self.spec.layers, self.spec.top_k), self.spec.none,
                                  dtype=self.spec.dtype, device=device)
        self._cpu: tuple[torch.Tensor, torch.Tensor] | None = None

    def step(self, step: int, live: torch.Tensor | None) -> None:
        """After the forward of the tokens sampled at `step` by the rows `live` (None: all)."""
        self.decoded[slice(None) if live is None else live, step] = self.recorder.take()

    def of(self, row: int, prefill_row: int, prompt: int, decoded: int) -> torch.Tensor:
        """[prompt + decoded, layers, top_k] on the CPU: the row's prompt positions, then its fed-back tokens."""
        if self._cpu is None:  # one copy per batch
            self._cpu = (self.prefill.cpu(), self.decoded.cpu())
        prefill, steps = self._cpu
        return torch.cat([prefill[prefill_row, self.width - prompt:], steps[row, :decoded]])


class HFEngine:
    """Rollout engine over a transformers causal LM; see the module docstring.

    `stats` holds running counters: `generated_tokens`, `generation_seconds` (wall time spent in
    batched generation, for tokens/s), `requests`, `batches`, `forward_passes`, `forward_rows`
    (sum of batch rows over all forward passes: how much work decoding really did),
    `max_batch_rows`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        eos_token_ids: Iterable[int],
        max_batch_size: int = 256,
        device: str | torch.device | None = None,
        seed: int = 0,
        copy_model: bool = True,
        share_prefill: bool = True,
        static_cache: bool | None = None,
        static_cache_max_bytes: int | None = None,
        compile_decode: bool | None = None,
        compile_scope: str = "modules",
        borrowed: Iterable[str] = (),
        record_routing: bool = False,
        prefill_chunk: int | None = 8192,
    ) -> None:
        """`model` is copied (unless `copy_model=False`) so training the caller's model never
        changes the engine's weights behind its back; only `update_weights` does. `tokenizer` is
        only used to decode responses for stop strings and may be None when none are used.
        `share_prefill`: requests of a batch with the same prompt (a GRPO group) share one prefill.
        `static_cache` (train/engines/static_decode.py): decode over a preallocated KV cache, with
        CUDA graphs on GPU; None = on CUDA for models whose layers all use full attention, False =
        always the dynamic cache, True = also on CPU (no graphs there; tests compare the two paths).
        `static_cache_max_bytes`: the most its KV buffers may take (None: half the free GPU memory;
        no limit on CPU); a larger batch is decoded in consecutive parts that fit.
        `compile_decode`: torch.compile this engine's norm and MLP module instances
        (static_decode.compile_decode_modules) so their element-wise work runs fused; None = with the
        static path on CUDA (measured 1.07-1.19x there), off on CPU. A compile that fails is recorded in
        `compile_error` and the engine goes on eagerly. `compile_scope`: "modules" (the above) or "layers":
        each whole decoder layer compiled for the static path's decode steps (static_decode.CompiledLayers;
        RoPE, residual adds and bias adds fused too; the prefill and the dynamic path stay eager).
        `borrowed`: names of tensors the model borrows from the trainer's actor (rollout.share_actor_base,
        train/models/shared_base.py): a push may not write them, and `sleep()` leaves them in place.
        `record_routing` (a mixture of experts; actor.router_replay): every Generation's `extra["routing"]`
        holds the experts each position was routed to, [prompt + sampled - 1, layers, top_k]
        (train/models/router_replay.py). Recording takes the dynamic path: CUDA graphs would skip the hooks.
        `prefill_chunk`: prompts longer than this many tokens are prefilled in chunks of it through the KV
        cache, so a long prompt's attention holds [rows, heads, chunk, prompt] scores, not [prompt, prompt]
        (the logits are the last position's only, either way); None: one pass. A recorded routing's prefill
        stays one pass."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 or None, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = copy.deepcopy(model) if copy_model else model
        if device is not None:
            self.model.to(device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype  # pushed weights are cast to it before they travel
        self.tokenizer = tokenizer
        self.borrowed = frozenset(borrowed)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_batch_size = int(max_batch_size)
        self.share_prefill = share_prefill
        if static_cache is None:
            static_cache = self.device.type == "cuda"
        self._routing = RoutingRecorder(self.model) if record_routing else None
        self.static_cache = bool(static_cache) and supports_static_decode(self.model) and not record_routing
        if self.static_cache:
            install_grouped_decode_attention(self.model)
        self._static: StaticDecoder | None = None  # kept across batches while its shapes fit
        self.static_cache_max_bytes = static_cache_max_bytes
        # why a static batch could not capture graphs: later decoders then run without (a capture that failed
        # once fails again: the model synchronises with the host, say), rather than fail at every rebuild
        self.static_error: str | None = None
        self.compile_error: str | None = None  # why compiled modules were given up (compile_decode)
        config = getattr(self.model, "config", None)
        # A vision-language model (train/models/vlm.py): prompts may carry images, prefilled with their
        # pixels at multimodal rotary positions; decoding continues as text.
        self.vision = VisionSpec.from_config(config) if is_vision_config(config) else None
        # a VLM's placeholder tokens, never sampled (train/algorithms/logits.py mask_unsampled)
        self._unsampled: torch.Tensor | None = None
        if self.vision is not None:
            self.static_cache = False  # the static decoder's graphs take text positions only
            self._unsampled = torch.tensor(self.vision.unsampled_ids, device=self.device)
        self.vocab_size: int | None = getattr(text_config(config), "vocab_size", None)
        self.max_positions: int | None = getattr(text_config(config), "max_position_embeddings", None)
        # Computing logits only for the last position saves a (batch, prompt_len, vocab) tensor.
        forward_args = inspect.signature(self.model.forward).parameters
        self._logits_to_keep = "logits_to_keep" in forward_args
        # transformers 5.24 renamed the KV-cache argument (the old name warns, and goes in 5.40).
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._generator = torch.Generator().manual_seed(seed)  # for requests without a seed
        # One worker: batches run one at a time, and the lock keeps update_weights/sleep/wake
        # from touching the weights while a batch is generating.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._lock = threading.Lock()
        self._state: _LoopState | None = None
        self._asleep = False
        self._offloaded = False
        self._host = HostSlab(pin=self.device.type == "cuda")  # where sleep() puts the weights it owns
        self._targets: dict[str, torch.Tensor] | None = None  # _named_targets, built once
        self._checksummer = Checksummer()  # weight_checksums' layouts, kept between pushes (under _lock)
        # Which weights the engine holds (the trainer's step that produced them; set after each push):
        # every Generation carries the version it was sampled with.
        self.weight_version = 0
        self.stats: dict[str, float] = {
            "generated_tokens": 0,
            "generation_seconds": 0.0,
            "requests": 0,
            "batches": 0,
            "forward_passes": 0,
            "forward_rows": 0,
            "max_batch_rows": 0,
            "prefill_rows_shared": 0,  # requests whose prompt was prefilled once for several of them
            "prefill_chunks": 0,  # forwards of prompts prefilled in chunks (prefill_chunk)
            "static_batches": 0,  # batches decoded over the preallocated cache (static_decode.py)
            "cuda_graphs": 0,  # decode graphs captured
            "static_parts": 0,  # parts of batches split to fit the static buffers' memory
            "compiled_modules": 0,  # module instances running compiled (compile_decode)
        }
        if compile_scope not in ("modules", "layers"):
            raise ValueError(f"compile_scope must be 'modules' or 'layers', got {compile_scope!r}")
        if compile_decode is None:
            compile_decode = self.static_cache and self.device.type == "cuda"
        self._compiled_layers: CompiledLayers | None = None  # compile_scope "layers": what the static path runs
        if compile_decode and compile_scope == "layers":
            if self.static_cache:  # only the static path's steps run them
                self._compiled_layers = CompiledLayers(self.model)
                self.stats["compiled_modules"] = len(self._compiled_layers)
        elif compile_decode:
            self.stats["compiled_modules"] = compile_decode_modules(self.model)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        tokenizer: Any = None,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        lora: Any = None,
        **kw: Any,
    ) -> "HFEngine":
        """Load a local checkpoint directory, or a peft LoRA adapter folder (its base model, named in
        adapter_config.json, with the adapter merged in). `dtype` None means bfloat16 on CUDA,
        float32 elsewhere. `lora` (train/models/lora.py): LoRA layers as the trainer's actor has them,
        B = 0 until the first push, which then sends adapters only. `kw` goes to the constructor;
        `eos_token_ids` defaults to the generation config's EOS ids, else the tokenizer's."""
        from transformers import AutoConfig, AutoTokenizer

        from train.models.lora import apply_lora, base_model_of

        base = base_model_of(path)
        if base is not None:  # an adapter folder (train.serve can serve latest/adapter)
            from peft import PeftModel

            model = model_class(AutoConfig.from_pretrained(base)).from_pretrained(base, dtype=resolve_dtype(dtype, device))
            model = PeftModel.from_pretrained(model, path).merge_and_unload()
        else:
            model = model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=resolve_dtype(dtype, device))
        if lora is not None and lora.enabled:
            apply_lora(model, lora)
            with torch.no_grad():  # the base model's outputs until the first push
                for name, value in model.named_parameters():
                    if ".lora_B." in name:
                        value.zero_()
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(path)
        if "eos_token_ids" not in kw:
            kw["eos_token_ids"] = default_eos_token_ids(model, tokenizer)
        kw.setdefault("copy_model", False)  # freshly loaded: nobody else holds it
        return cls(model, tokenizer, device=device, **kw)

    # ------------------------------------------------------------------ public API

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, images: Iterable = ()) -> Generation:
        """Generate one response; concurrent calls are batched together. `images` (a vision-language model):
        the ImageInputs (train/datasets/vision.py) of the prompt's image placeholder runs, in order."""
        prompt_ids = [int(t) for t in prompt_ids]
        images = tuple(images)
        self._check_request(prompt_ids, sampling)
        self._check_images(prompt_ids, images)
        state = self._loop_state()
        future = state.loop.create_future()
        state.pending.append(_Request(prompt_ids, sampling, future, images))
        state.wakeup.set()
        return await future

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Copy full tensors into the engine's parameters/buffers by state_dict name.

        Waits for a running batch to finish first. Tied weights share storage, so pushing either
        name updates both. DTensors are gathered with `full_tensor()`. A tensor that already is
        the target's storage is skipped (no copy); on a sleeping GPU engine, pushed tensors go
        straight to the GPU (see the module docstring)."""
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        with self._lock:
            targets = self._named_targets()
            with torch.no_grad():
                # A group of tensors at a time: the plain copies go in one multi-tensor call.
                for group in grouped(named_tensors, CHUNK_BYTES):
                    into: list[torch.Tensor] = []
                    froms: list[torch.Tensor] = []
                    for name, tensor in group:
                        target = self._target(targets, name, tensor)
                        if hasattr(tensor, "full_tensor"):
                            tensor = tensor.full_tensor()
                        if tuple(tensor.shape) != tuple(target.shape):
                            raise ValueError(
                                f"update_weights: shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                                f"the engine's model has {tuple(target.shape)}"
                            )
                        if same_storage(target, tensor):
                            continue  # the engine shares this tensor with the trainer: nothing to copy
                        if self._offloaded and target.device != self.device:
                            # Asleep: new device storage filled from the pushed tensor, not from the host copy.
                            fresh = torch.empty(target.shape, dtype=target.dtype, device=self.device)
                            fresh.copy_(tensor)
                            target.data = fresh
                            continue
                        into.append(target)
                        froms.append(tensor)  # under no_grad: no detach (a view op per tensor)
                    self._copy(into, froms)

    def _copy(self, into: list[torch.Tensor], froms: list[torch.Tensor]) -> None:
        """Write pushed values into the engine's tensors: one multi-tensor copy (with the dtype cast); none for
        an empty group (all shared or written while asleep)."""
        if into:
            torch._foreach_copy_(into, froms)

    def _target(self, targets: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The engine's tensor that a push of `name` writes, or an error naming what is wrong. A borrowed tensor
        may only be pushed as itself (a full fine-tune's weights, which the push then skips)."""
        target = targets.get(name)
        if name in self.borrowed and not (target is not None and same_storage(target, tensor)):
            raise ValueError(f"update_weights: {name!r} is the actor's own tensor, which this engine "
                             "borrows (rollout.share_actor_base): a push must not write it (with LoRA "
                             "only the adapters are pushed)")
        if target is None:
            known = ", ".join(list(targets)[:5])
            raise KeyError(
                f"update_weights: the engine's model has no parameter or buffer named "
                f"{name!r} (names are the model's state_dict keys, e.g. {known}, ...)"
            )
        return target

    def weight_checksums(self, names: Iterable[str]) -> dict[str, int]:
        """The exact checksum (train/utils/checksum.py) of what the engine holds under each name it
        has: the trainer compares them with what it pushed (trainer.verify_push). A group of tensors at
        a time, in layouts kept from the last push, read back once."""
        with self._lock, torch.no_grad():
            targets = self._named_targets()
            held = [n for n in names if n in targets]
            sums = self._checksummer([targets[n] for n in held]).tolist()
            self._checksummer.release()  # no staging memory held between pushes
            return dict(zip(held, sums))

    def score(self, token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """log p(token i | tokens < i) at `temperature` for i >= 1, as the sampler computes them
        (float32 log-softmax of logits / temperature): the sync probe's engine side."""
        if len(token_ids) < 2:
            raise ValueError("score: need at least two tokens")
        with self._lock, torch.inference_mode():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._wake_locked()
            ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            logits = mask_unsampled(self.model(input_ids=ids, use_cache=False).logits[0, :-1].float(), self._unsampled)
            logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            return logp.gather(1, ids[0, 1:, None]).squeeze(1).cpu()

    def tokens_per_second(self) -> float:
        """Generated tokens per second of batched generation so far."""
        seconds = self.stats["generation_seconds"]
        return self.stats["generated_tokens"] / seconds if seconds > 0 else 0.0

    def sleep(self) -> None:
        """Free accelerator memory for training. On CPU this is a no-op: the model stays resident
        (there is nothing to free for). On an accelerator the weights move to host memory and come
        back with `wake()`, so no weight push is needed after waking."""
        with self._lock:
            if self._asleep:
                return
            self._asleep = True
            if self.device.type != "cpu":
                self._static = None  # its KV buffers and graphs: captured again after waking
                owned: dict[int, torch.Tensor] = {}  # each tensor once: tied names are one parameter
                for name, tensor in self._named_targets().items():
                    if name not in self.borrowed and tensor.device.type != "cpu":  # (borrowed: the actor's)
                        owned.setdefault(id(tensor), tensor)
                tensors = list(owned.values())
                with torch.no_grad():
                    # Into one page-locked slab of exactly their bytes (train/utils/host_slab.py), kept for the
                    # next sleep: the copies queue on the stream, one wait below for all of them (the device
                    # blocks dropped here are reused only by work queued after the copies).
                    for tensor, host in zip(tensors, self._host.hold(tensors)):
                        tensor.data = host
                self._offloaded = True
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                    torch.cuda.empty_cache()

    @property
    def host_bytes(self) -> int:
        """Host memory the engine's sleep holds its weights in (page-locked on CUDA): exactly their bytes, each
        tensor's rounded up to 512; 0 before the first sleep on a GPU and always on a CPU."""
        return self._host.nbytes

    def wake(self) -> None:
        """Undo `sleep()`. Generating while asleep wakes the engine implicitly."""
        with self._lock:
            self._wake_locked()

    def close(self) -> None:
        """Stop the worker thread; the engine cannot generate afterwards."""
        self._executor.shutdown(wait=True)
        with self._lock:  # (asleep, the weights' views keep the slab's memory, no longer page-locked)
            self._host.release()

    # ------------------------------------------------------------------ batching

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._state
        if state is None or state.loop is not loop or state.task is None or state.task.done():
            # A new loop (or the old task died): earlier futures belong to a dead loop, start anew.
            state = _LoopState(loop=loop)
            state.task = loop.create_task(self._batch_loop(state), name="hf-engine-batcher")
            self._state = state
        return state

    async def _batch_loop(self, state: _LoopState) -> None:
        while True:
            await state.wakeup.wait()
            state.wakeup.clear()
            # Coroutines started in the same tick (asyncio.gather) have not all enqueued yet.
            await asyncio.sleep(0)
            while state.pending:
                live = [r for r in state.pending if not r.future.done()]
                batch, state.pending = live[: self.max_batch_size], live[self.max_batch_size :]
                if not batch:
                    continue
                try:
                    results = await state.loop.run_in_executor(
                        self._executor,
                        self._generate_batch,
                        [(r.prompt_ids, r.sampling, r.images) for r in batch],
                    )
                except asyncio.CancelledError:
                    for r in batch:
                        if not r.future.done():
                            r.future.cancel()
                    raise
                except Exception as exc:  # the batch failed: every caller in it sees the error
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
                for r, result in zip(batch, results):
                    if not r.future.done():
                        r.future.set_result(result)

    def _check_images(self, prompt_ids: list[int], images: tuple) -> None:
        if self.vision is None:
            if images:
                raise ValueError("generate: images given to a text-only model")
            return
        spans = image_spans(prompt_ids, self.vision.image_token_id)
        if len(spans) != len(images) or any(e - s != im.tokens for (s, e), im in zip(spans, images)):
            raise ValueError(f"generate: the prompt's image placeholder runs {[e - s for s, e in spans]} do not match "
                             f"the images given (tokens {[im.tokens for im in images]})")

    def _check_request(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"generate: prompt token ids must lie in [0, {self.vocab_size})")
        if sampling.temperature < 0:
            raise ValueError(f"generate: temperature must be >= 0, got {sampling.temperature}")
        if not 0 < sampling.top_p <= 1:
            raise ValueError(f"generate: top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.extra:
            raise ValueError(f"generate: the hf engine does not take {', '.join(k for k, _ in sampling.extra)} "
                             "(engine-specific sampling parameters)")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("generate: stop strings need a tokenizer; build HFEngine with one")

    # ------------------------------------------------------------------ generation (worker thread)

    def _generate_batch(self, requests: list[tuple[list[int], SamplingParams, tuple]]) -> list[Generation]:
        with self._lock, torch.inference_mode():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # per thread: this worker thread's default is cuda:0
            self._wake_locked()
            start = time.perf_counter()
            try:
                results = self._decode_in_parts(requests)
            except torch.OutOfMemoryError:  # not the compiler's doing: eager modules would not need less
                raise
            except Exception as exc:
                if not self.stats["compiled_modules"]:
                    raise
                # Compiling failed (no compiler, an unsupported op): the same batch again, eagerly.
                self.compile_error = f"{type(exc).__name__}: {exc}"
                uncompile_modules(self.model)
                self._compiled_layers = None
                self.stats["compiled_modules"] = 0
                self._static = None  # its graphs may hold compiled kernels
                results = self._decode_in_parts(requests)
            self.stats["generation_seconds"] += time.perf_counter() - start
            self.stats["generated_tokens"] += sum(len(g.token_ids) for g in results)
            self.stats["requests"] += len(requests)
            self.stats["batches"] += 1
            self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(requests))
            return results

    def _prefill(self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
                 cache: DynamicCache, vision: dict | None = None) -> torch.Tensor:
        """The prompts' last logits, their keys and values left in `cache`: one forward, or with prompts
        longer than `prefill_chunk` one per chunk of columns, each attending to the cache and itself. `vision`:
        the rows' pixels and grids (one pass: an image's features scatter over its placeholders wherever they are)."""
        width, chunk = input_ids.shape[1], self.prefill_chunk
        if chunk is None or width <= chunk or self._routing is not None or vision:
            return self._forward(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                                 **{self._cache_arg: cache}, **(vision or {}))
        for start in range(0, width, chunk):
            end = min(start + chunk, width)
            logits = self._forward(input_ids=input_ids[:, start:end], attention_mask=attention[:, :end],
                                   position_ids=positions[:, start:end], **{self._cache_arg: cache})
        self.stats["prefill_chunks"] += -(-width // chunk)
        return logits

    def _forward(self, **inputs: Any) -> torch.Tensor:
        if self._logits_to_keep:
            inputs["logits_to_keep"] = 1
        logits = self.model(**inputs, use_cache=True).logits[:, -1, :]
        self.stats["forward_passes"] += 1
        self.stats["forward_rows"] += logits.shape[0]
        return logits

    def _decode_in_parts(self, requests: list[tuple[list[int], SamplingParams, tuple]]) -> list[Generation]:
        """Static decoding keeps rows x columns of keys and values: a batch with more rows than its
        memory allows is decoded in consecutive parts of a power-of-two size that fits (each far
        faster than the dynamic path's eager steps). Seeded requests sample the same either way."""
        rows = self._static_rows_that_fit(requests)
        if rows is None or len(requests) <= rows:
            return self._decode(requests)
        self.stats["static_parts"] += -(-len(requests) // rows)
        return [g for start in range(0, len(requests), rows) for g in self._decode(requests[start:start + rows])]

    def _static_byte_limit(self, freed_after: int = 0) -> float | None:
        """The most the static KV buffers may take: `static_cache_max_bytes`, else half the free GPU
        memory (the allocator's unused blocks, the current buffers and `freed_after` bytes about to be freed,
        the prefill's cache, counted as free); None on CPU (no limit)."""
        if self.static_cache_max_bytes is not None:
            return float(self.static_cache_max_bytes)
        if self.device.type != "cuda":
            return None
        free = free_device_bytes(self.device) + freed_after
        return (free + (self._static.nbytes() if self._static is not None else 0)) / 2

    def _static_rows_that_fit(self, requests: list[tuple[list[int], SamplingParams, tuple]]) -> int | None:
        """How many rows of this batch's columns the static buffers can hold (a power of two); None
        when the static path is off, unlimited, or cannot hold even one row."""
        config = getattr(self.model, "config", None)
        limit = self._static_byte_limit() if self.static_cache else None
        if limit is None or config is None:
            return None
        columns = column_bucket(max(len(p) + sp.max_new_tokens for p, sp, _ in requests))
        per_row = columns * kv_bytes_per_token(config, self.dtype)
        fit = int(limit // per_row)
        return row_bucket(fit + 1) // 2 if fit >= 1 else None

    def _decode(self, requests: list[tuple[list[int], SamplingParams, tuple]]) -> list[Generation]:
        results: list[Generation | None] = [None] * len(requests)
        budgets = []
        for prompt, sp, _ in requests:
            budget = sp.max_new_tokens
            if self.max_positions is not None:
                # prompt + response must fit the positions the trainer will run the model on.
                budget = min(budget, self.max_positions - len(prompt))
            budgets.append(budget)
        rows = [i for i, b in enumerate(budgets) if b > 0]
        for i, b in enumerate(budgets):
            if b <= 0:
                results[i] = Generation([], [], "length", {"prompt_tokens": len(requests[i][0])})
        if not rows:
            return results  # type: ignore[return-value]

        dev = self.device
        prompts = [requests[i][0] for i in rows]
        params = [requests[i][1] for i in rows]
        images = [requests[i][2] for i in rows]
        n, width = len(rows), max(len(p) for p in prompts)
        # One prefill row per distinct prompt (a group's G requests share theirs; with images, the same
        # pixels too); its KV cache rows and last logits are repeated for every request of that prompt afterwards.
        distinct: dict[tuple, int] = {}
        owner = [distinct.setdefault((tuple(p), tuple(im.digest for im in ims)), len(distinct))
                 for p, ims in zip(prompts, images)]
        shared = self.share_prefill and len(distinct) < n
        first = {o: j for j, o in reversed(list(enumerate(owner)))}  # the first request of each distinct prompt
        prefill_rows = [first[o] for o in range(len(distinct))] if shared else list(range(n))
        prefill = [prompts[j] for j in prefill_rows]
        input_ids = torch.zeros(len(prefill), width, dtype=torch.long)
        attention = torch.zeros(len(prefill), width, dtype=torch.long)
        for j, p in enumerate(prefill):  # left padding: every row's last token is in the last column
            input_ids[j, width - len(p) :] = torch.tensor(p)
            attention[j, width - len(p) :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        next_pos = torch.tensor([len(p) for p in prompts], device=dev)
        vision = None
        if self.vision is not None and any(images):
            positions, vision, after = self._vision_inputs(prefill, [images[j] for j in prefill_rows], width)
            # decoding continues as text from each prompt's next rotary position
            next_pos = after[torch.tensor(owner)].to(dev) if shared else after.to(dev)
        temp = torch.tensor([sp.temperature for sp in params], device=dev, dtype=torch.float32)
        top_p = torch.tensor([sp.top_p for sp in params], device=dev, dtype=torch.float32)
        top_k = torch.tensor([sp.top_k for sp in params], device=dev, dtype=torch.long)
        # Optional per-row processing, built only when some row asks for it (the common case pays nothing).
        min_p = (torch.tensor([sp.min_p for sp in params], device=dev, dtype=torch.float32)
                 if any(sp.min_p > 0 for sp in params) else None)
        penalties: Penalties | None = None
        stop_ids = [frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else self.eos_token_ids)
                    for sp in params]
        # Every row's uniforms for its whole response, drawn up front: a seeded row from its own
        # generator (so its sample depends only on its seed), the others from the engine's.
        uniforms = self._uniforms(params, [budgets[i] for i in rows])
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        active = list(range(n))  # positions in `rows` still decoding, in batch order

        cache = DynamicCache(config=getattr(self.model, "config", None))
        if self._routing is not None:
            self._routing.clear()  # (a scoring pass may have left calls behind)
        logits = self._prefill(input_ids, attention, positions, cache, vision)
        routes = None if self._routing is None else _Routes(self._routing, len(prefill), width, n,
                                                           max(budgets[i] for i in rows), dev)
        if shared:
            expand = torch.tensor(owner, device=dev)
            cache.batch_select_indices(expand)
            logits, attention = logits[expand], attention[expand]
            self.stats["prefill_rows_shared"] += n - len(prefill)
        if any(sp.uses_penalties for sp in params):
            penalties = Penalties(prompts, params, logits.shape[-1], dev)
        static = self._static_decoder(cache, n, width + max(budgets[i] for i in rows))
        if static is not None:
            static.start(cache, attention, next_pos)
            del cache  # its rows now live in the decoder's buffers
            captured = static.captures
        uniforms = uniforms.to(dev)  # once: no host-to-device copy per step
        live = None  # device index of the active rows (None: all of them)
        flags = None  # what sample_tokens is told of the active rows (and asks_min_p), set again when rows drop
        while True:
            step = len(tokens[active[0]])  # every active row has sampled as many tokens
            u = uniforms[:, step] if live is None else uniforms[live, step]
            if penalties is not None:
                logits = penalties.apply(logits)
            if self._unsampled is not None:
                logits = mask_unsampled(logits.float(), self._unsampled)
            if flags is None:  # per row on the host, so sampling never waits for the GPU to decide
                vocab = logits.shape[-1]
                flags = {"any_sampled": any(params[j].temperature > 0 for j in active),
                         "filtered": torch.tensor([b for b, j in enumerate(active) if params[j].top_p < 1
                                                   or 0 < params[j].top_k < vocab], dtype=torch.long, device=dev),
                         "unit_temperature": all(params[j].temperature in (0, 1) for j in active),
                         "any_greedy": any(params[j].temperature <= 0 for j in active)}
                asks_min_p = any(params[j].min_p > 0 for j in active)
            tok, lp = sample_tokens(logits, temp, top_p, top_k, u, min_p if asks_min_p else None, **flags)
            if penalties is not None:
                penalties.record(tok)
            keep: list[int] = []
            # One device-to-host copy per step for both (token ids are exact in float64).
            sampled_tok, sampled_lp = torch.stack((tok.double(), lp.double())).tolist()
            for b, (j, t, l) in enumerate(zip(active, sampled_tok, sampled_lp)):
                t = int(t)
                tokens[j].append(t)
                logprobs[j].append(l)
                reason = self._finish_reason(tokens[j], params[j], budgets[rows[j]], stop_ids[j])
                if reason is None:
                    keep.append(b)
                else:
                    extra = {"prompt_tokens": len(prompts[j]), "batch_size": n, "weight_version": self.weight_version}
                    results[rows[j]] = Generation(tokens[j], logprobs[j], reason, extra)
            if not keep:
                break
            if len(keep) < len(active):
                # Drop finished rows so they cost nothing from here on.
                idx = torch.tensor(keep, device=dev)
                if static is not None:
                    static.select(idx)
                else:
                    cache.batch_select_indices(idx)
                    attention, next_pos = attention[idx], next_pos[idx]
                tok = tok[idx]
                temp, top_p, top_k = temp[idx], top_p[idx], top_k[idx]
                min_p = min_p[idx] if min_p is not None else None
                if penalties is not None:
                    penalties.select(idx)
                active = [active[b] for b in keep]
                live = torch.tensor(active, device=dev)
                flags = None
            if static is not None:
                logits = static.step(tok)
                self.stats["forward_passes"] += 1
                self.stats["forward_rows"] += static.bucket
                continue
            attention = torch.cat([attention, attention.new_ones(len(active), 1)], dim=1)
            logits = self._forward(
                input_ids=tok[:, None],
                attention_mask=attention,
                position_ids=next_pos[:, None],
                **{self._cache_arg: cache},
            )
            next_pos = next_pos + 1
            if routes is not None:
                routes.step(step, live)
        if static is not None:
            self.stats["cuda_graphs"] += static.captures - captured
            self.static_error = self.static_error or static.capture_error
        if routes is not None:
            for j, (p, got) in enumerate(zip(prompts, tokens)):
                results[rows[j]].extra["routing"] = routes.of(j, owner[j] if shared else j, len(p), len(got) - 1)
        return results  # type: ignore[return-value]

    def _vision_inputs(self, prompts: list[list[int]], images: list[tuple], width: int,
                       ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """Multimodal rotary positions [3, rows, width] of left-padded prompts, the forward's pixel inputs (all
        rows' images in row order), and each row's next position (where decoding continues)."""
        dev = self.device
        positions = torch.zeros(3, len(prompts), width, dtype=torch.long)
        after = torch.zeros(len(prompts), dtype=torch.long)
        for j, (p, ims) in enumerate(zip(prompts, images)):
            grids = torch.stack([im.grid for im in ims]) if ims else None
            pos = mrope_positions(p, grids, self.vision)
            positions[:, j, width - len(p):] = pos
            after[j] = int(pos[:, -1].max()) + 1
        every = [im for ims in images for im in ims]
        dtype = next(self.model.parameters()).dtype
        vision = {"pixel_values": torch.cat([im.pixel_values for im in every]).to(dev, dtype),
                  "image_grid_thw": torch.stack([im.grid for im in every]).to(dev)} if every else {}
        return positions.to(dev), vision, after

    def _static_decoder(self, prefill: DynamicCache, rows: int, columns: int) -> StaticDecoder | None:
        """The engine's static decoder, (re)built to hold `rows` x `columns`; None where this batch
        takes the dynamic path (option off, or its buffers would exceed `_static_byte_limit`)."""
        if not self.static_cache:
            return None
        weights_key = tuple(t.data_ptr() for t in self._named_targets().values())
        old = self._static
        if old is not None and old.fits(rows, columns) and old.weights_key == weights_key:
            self.stats["static_batches"] += 1
            return old
        # the prefill's cache moves into the buffers and is freed: the same room as before the prefill
        limit = self._static_byte_limit(sum(t.nbytes for layer in prefill.layers for t in (layer.keys, layer.values)))
        old_shape = (old.rows, old.columns) if old is not None else None
        self._static = old = None  # graphs of moved weights or smaller shapes: dropped (and their memory)
        kv_shapes = [(layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3]) for layer in prefill.layers]
        dtype = prefill.layers[0].keys.dtype
        per_cell = sum(h * (dk + dv) for h, dk, dv in kv_shapes) * dtype.itemsize  # one row, one column
        rows, columns = row_bucket(rows), column_bucket(columns)
        if old_shape is not None:  # grow to cover both shapes, so alternating batches keep one set of graphs
            wider = (max(rows, old_shape[0]), max(columns, old_shape[1]))
            if limit is None or wider[0] * wider[1] * per_cell <= limit:
                rows, columns = wider
        if limit is not None and rows * columns * per_cell > limit:
            return None
        self._static = StaticDecoder(self.model, self._cache_arg, self._logits_to_keep, rows, columns, kv_shapes,
                                     dtype, self.device, self.device.type == "cuda" and self.static_error is None,
                                     weights_key,
                                     self._compiled_layers)
        self.stats["static_batches"] += 1
        return self._static

    def _uniforms(self, params: list[SamplingParams], budgets: list[int]) -> torch.Tensor:
        """[rows, longest budget] uniforms in (0, 1]: entry t is what the row's t-th token draws."""
        width = max(budgets)
        u = torch.rand(len(params), width, generator=self._generator, dtype=torch.float64)
        for b, sp in enumerate(params):
            if sp.seed is not None:  # the stream's entries from seed_offset on (a continued turn)
                u[b, : budgets[b]] = torch.rand(sp.seed_offset + budgets[b],
                                                generator=torch.Generator().manual_seed(sp.seed),
                                                dtype=torch.float64)[sp.seed_offset:]
        return 1.0 - u  # (0, 1]: a zero-probability token can never be picked

    def _finish_reason(self, tokens: list[int], sp: SamplingParams, budget: int,
                       stop_ids: frozenset[int]) -> str | None:
        if tokens[-1] in stop_ids:  # EOS (unless ignore_eos) and stop_token_ids
            return "stop"
        if sp.stop and self._hits_stop_string(tokens, sp.stop):
            return "stop"
        if len(tokens) >= budget:
            return "length"
        return None

    def _hits_stop_string(self, tokens: list[int], stops: tuple[str, ...]) -> bool:
        # The check runs after every token, so a stop string can only be completed by the newest
        # one: decoding a tail long enough to hold the longest stop string (a character is at most
        # 4 byte-level tokens) is enough and keeps the check O(1) per token.
        window = 4 * max(len(s) for s in stops) + 4
        text = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
        return any(s and s in text for s in stops)

    def _named_targets(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer by state_dict name, built once (at the first push or sleep: the model's
        modules are final by then). The objects stay: sleep, wake and a push while asleep swap their `.data`."""
        if self._targets is None:
            targets: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
            for name, buf in self.model.named_buffers():  # non-persistent buffers too
                targets.setdefault(name, buf)
            self._targets = targets
        return self._targets

    def _wake_locked(self) -> None:
        if self._offloaded:
            hosts = []  # kept alive until the asynchronous uploads are done
            with torch.no_grad():
                for tensor in self._named_targets().values():
                    if tensor.device != self.device:  # not pushed while asleep: upload the host copy
                        hosts.append(tensor.data)
                        tensor.data = tensor.data.to(self.device, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            del hosts
            self._offloaded = False
        self._asleep = False


def resolve_dtype(dtype: torch.dtype | str | None, device: str | torch.device) -> torch.dtype:
    """None: bfloat16 on CUDA (tensor cores, half the memory), float32 elsewhere (models/config.py compute_dtype)."""
    if dtype is None:
        dtype = compute_dtype(None, torch.device(device).type)
    if isinstance(dtype, str):
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"engine dtype must be float32, bfloat16 or float16, got {dtype!r}")
        return getattr(torch, dtype)
    return dtype


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when `b` is exactly `a`'s memory (same device, dtype, shape, strides and address)."""
    return (
        a.data_ptr() == b.data_ptr()  # first: it differs in almost every call, and is the cheapest to ask
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def default_eos_token_ids(model: torch.nn.Module, tokenizer: Any = None) -> list[int]:
    """EOS ids from the model's generation config (may list several, e.g. <|im_end|> and
    <|endoftext|>), else from the tokenizer."""
    ids: list[int] = []
    gen_config = getattr(model, "generation_config", None)
    eos = getattr(gen_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids = [eos]
    elif eos is not None:
        ids = [int(t) for t in eos]
    return ids
