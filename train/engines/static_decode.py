"""Decoding over a preallocated KV cache, with CUDA graphs on GPU: the `hf` engine's fast path.

Why: an eager transformers decode step launches hundreds of small kernels from Python, and at RL
batch sizes on a GPU that launch time, not the GPU, sets the pace (measured on an H100: ~70 ms a
step for a 0.5B model at batch 64 and at batch 256 alike). A CUDA graph replays a whole step's
kernels with one launch, but it needs fixed shapes and fixed addresses, which a `DynamicCache`
(growing by concatenation, rows evicted by copying) does not have.

How:
- `SlotCache` is a transformers cache whose keys and values live in preallocated
  [rows, kv_heads, columns, head_dim] buffers. A decode step writes one column (an `index_copy_`
  at a device-side index, so the same graph serves every step) and attention reads a fixed prefix
  of the columns, masked by an explicit additive [rows, 1, 1, columns] mask (transformers returns
  a 4D mask as it is, so no mask is built inside the graph).
- Rows are padded to a power-of-two bucket and the columns read to a multiple of `COLUMN_BLOCK`.
  A graph is captured per (rows, columns) the first time that shape is used (that step runs
  eagerly and is the warm-up) and replayed after; all graphs share one memory pool.
- Finished rows stay in place, computed and ignored, until the live ones fit a smaller bucket;
  then the live rows move to the front (one copy of their KV) and the smaller graph takes over.
  That is at most twice the rows that exact eviction (the dynamic path) computes.
- Prefill stays eager on a `DynamicCache`, exactly as on the dynamic path, and its keys and values
  are copied into the buffers; every row's columns are aligned (left padding), so all rows write
  the same column at each step.
- On CPU the same code runs without graphs (tests use that to check it against the dynamic path).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import DynamicCache

from train.models.memory_plan import attention_heads

COLUMN_BLOCK = 256  # attention reads columns in blocks of this many: few graphs, little wasted reading


def row_bucket(n: int) -> int:
    """The power of two >= n: the batch sizes graphs are captured for."""
    return 1 << max(0, (n - 1).bit_length())


def column_bucket(columns: int, limit: int | None = None) -> int:
    """`columns` rounded up to a whole block (at most `limit`): the key lengths graphs read."""
    rounded = -(-columns // COLUMN_BLOCK) * COLUMN_BLOCK
    return rounded if limit is None else min(limit, rounded)


DECODE_ATTENTION = "infinite_rl_grouped_decode"


def grouped_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except for one-token queries of grouped-query attention: there
    the query heads that share a key/value head become that head's query rows, so the cache is read
    as it is. (With a mask, transformers' SDPA path copies every key/value head once per query head
    first, `repeat_kv`: at batch 256 that copy is most of a decode step's memory traffic.)"""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or heads == kv_heads or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # Query head h reads key/value head h // (heads / kv_heads), as repeat_kv lays them out.
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def install_grouped_decode_attention(model: torch.nn.Module) -> bool:
    """Switch an SDPA model to `grouped_decode_attention` (registered under its own name; no other
    model changes). Models on another attention implementation keep it. True when installed."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    AttentionInterface.register(DECODE_ATTENTION, grouped_decode_attention)
    # transformers builds masks by implementation name: the same masks as SDPA.
    ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(DECODE_ATTENTION)
    return True


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes over all layers (the static buffers' row size per column), from
    the config. (DeepSeek's latent attention caches less: its latent and rotary key, one head; the buffers take
    their widths from the prefill's cache, so this over-counts there.)"""
    _, head_dim, kv_heads = attention_heads(config)
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def supports_static_decode(model: torch.nn.Module) -> bool:
    """True when every layer of the model's cache is a plain full-attention `DynamicLayer` (no
    sliding window, linear or quantised layers: those keep the dynamic path)."""
    from transformers.cache_utils import DynamicLayer

    config = getattr(model, "config", None)
    if config is None:
        return False
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # a config transformers cannot build a cache from
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class SlotCache(DynamicCache):
    """Keys and values of `rows` rows in fixed buffers; `update` writes the column held by
    `column` (a one-element device tensor) and returns the first `columns` columns."""

    def __init__(self, config: Any, keys: list[torch.Tensor], values: list[torch.Tensor],
                 column: torch.Tensor, columns: int) -> None:
        super().__init__(config=config)
        self.slot_keys, self.slot_values, self.column, self.columns = keys, values, column, columns

    # Never traced: compiled decoder layers (`CompiledLayers`) break their graph here, so no graph reads
    # `layer_idx` and every layer shares one compiled code (else dynamo compiles a graph per layer).
    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.slot_keys[layer_idx], self.slot_values[layer_idx]
        keys.index_copy_(2, self.column, key_states.to(keys.dtype))
        values.index_copy_(2, self.column, value_states.to(values.dtype))
        return keys[:, :, : self.columns], values[:, :, : self.columns]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns


class StaticDecoder:
    """The buffers, graphs and live rows of static decoding for one engine. Reused across batches
    while a batch fits (`fits`) and the weights stay where they were (`weights_key`)."""

    def __init__(self, model: torch.nn.Module, cache_arg: str, logits_to_keep: bool, rows: int, columns: int,
                 kv_shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device,
                 use_graphs: bool, weights_key: tuple, compiled_layers: CompiledLayers | None = None) -> None:
        self.model, self.cache_arg, self.logits_to_keep = model, cache_arg, logits_to_keep
        # what each decode step's forward runs inside: the compiled layers installed, or nothing
        self.step_context = compiled_layers if compiled_layers is not None else contextlib.nullcontext()
        self.rows, self.columns, self.device, self.use_graphs = rows, columns, device, use_graphs
        self.weights_key = weights_key
        zeros = lambda heads, dim: torch.zeros(rows, heads, columns, dim, dtype=dtype, device=device)  # noqa: E731
        self.keys = [zeros(h, key_dim) for h, key_dim, _ in kv_shapes]  # (kv_shapes: heads, key and value widths)
        self.values = [zeros(h, value_dim) for h, _, value_dim in kv_shapes]
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.masked = torch.finfo(dtype).min
        self.mask = torch.full((rows, 1, 1, columns), self.masked, dtype=dtype, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.captures = 0
        self.compactions = 0
        self.capture_error: str | None = None

    def fits(self, rows: int, columns: int) -> bool:
        return rows <= self.rows and columns <= self.columns

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    # -------------------------------------------------------------------- one batch

    def start(self, prefill: DynamicCache, attention: torch.Tensor, next_positions: torch.Tensor) -> None:
        """Take over a prefilled batch: `prefill` holds n rows of `width` columns (already expanded
        to one row per request), `attention` [n, width] marks the real prompt tokens, and
        `next_positions` [n] is the position of each row's first generated token."""
        n, width = attention.shape
        for layer, slot_k, slot_v in zip(prefill.layers, self.keys, self.values):
            slot_k[:n, :, :width].copy_(layer.keys)
            slot_v[:n, :, :width].copy_(layer.values)
        self.mask[:n].fill_(self.masked)
        self.mask[:n, 0, 0, :width].masked_fill_(attention.bool(), 0.0)
        self.positions[:n, 0].copy_(next_positions)
        self.positions[n:].zero_()  # rows past the live ones are computed and ignored: keep their positions small
        self.next_column = width
        self.bucket = row_bucket(n)
        self.slots = torch.arange(n, device=self.device)  # the buffer row of each live row, in order

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the live rows at positions `keep` (of the current live order). When they fit a
        smaller bucket, move them to the front so the smaller graph serves them."""
        self.slots = self.slots[keep]
        live = self.slots.numel()
        if row_bucket(live) >= self.bucket:
            return
        used = self.next_column
        for buf in self.keys + self.values:  # only the columns written so far
            buf[:live, :, :used] = buf[:, :, :used].index_select(0, self.slots)
        self.mask[:live] = self.mask.index_select(0, self.slots)
        self.positions[:live] = self.positions.index_select(0, self.slots)
        self.slots = torch.arange(live, device=self.device)
        self.bucket = row_bucket(live)
        self.compactions += 1

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per live row (in live order); return their next-token logits [live, vocab].
        The logits are the graph's output buffer: read them before the next step."""
        col = self.next_column
        self.ids.index_copy_(0, self.slots, tokens[:, None])
        self.mask[: self.bucket, 0, 0, col] = 0.0
        self.column.fill_(col)
        logits = self._run(self.bucket, column_bucket(col + 1, self.columns))
        self.positions[: self.bucket] += 1
        self.next_column = col + 1
        return logits.index_select(0, self.slots)

    # -------------------------------------------------------------------- graphs

    def _forward(self, rows: int, columns: int) -> torch.Tensor:
        cache = SlotCache(getattr(self.model, "config", None), [k[:rows] for k in self.keys],
                          [v[:rows] for v in self.values], self.column, columns)
        kwargs: dict[str, Any] = {"input_ids": self.ids[:rows], "position_ids": self.positions[:rows],
                                  "attention_mask": self.mask[:rows, :, :, :columns], self.cache_arg: cache,
                                  "use_cache": True}
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with self.step_context:
            return self.model(**kwargs).logits[:, -1, :]

    def _run(self, rows: int, columns: int) -> torch.Tensor:
        graph = self.graphs.get((rows, columns))
        if graph is not None:
            graph[0].replay()
            return graph[1]
        logits = self._forward(rows, columns)  # this step, eagerly; also the capture's warm-up
        if self.use_graphs and self.capture_error is None:
            try:
                self.graphs[(rows, columns)] = self._capture(rows, columns)
                self.captures += 1
            except Exception as exc:  # a model that cannot be captured decodes eagerly on the same buffers
                self.capture_error = f"{type(exc).__name__}: {exc}"
        return logits

    def _capture(self, rows: int, columns: int) -> tuple[Any, torch.Tensor]:
        """One step's forward recorded (not run: the buffers are untouched) as a CUDA graph in the decoder's pool.
        On a side stream, in thread-local mode: the trainer's thread (an asynchronous rollout, the Tinker service)
        may allocate or synchronise meanwhile, which the global mode would refuse for the whole process, and
        without `torch.cuda.graph`'s process-wide synchronise and cache emptying. A capture that fails leaves the
        allocator and the thread's stream as they were."""
        graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = self._forward(rows, columns)
            except BaseException:
                _abandon_capture(graph, self.device, self.pool)
                raise
            try:
                graph.capture_end()
            except BaseException:
                _end_allocating_to_pool(self.device, self.pool)
                raise
        current.wait_stream(side)
        return graph, out


def _abandon_capture(graph: Any, device: torch.device, pool: Any) -> None:
    """End a capture whose forward raised (ending it may raise too: the capture is invalid either way)."""
    try:
        graph.capture_end()
    except Exception:
        _end_allocating_to_pool(device, pool)


def _end_allocating_to_pool(device: torch.device, pool: Any) -> None:
    """The allocator stops sending allocations to the graphs' pool: `capture_end` does this only once the stream
    has left capture mode, so a failed end would leave it routing there (and `empty_cache` freeing nothing)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        try:
            end(device.index if device.index is not None else torch.cuda.current_device(), pool)
        except Exception:  # already ended
            pass


# Module types whose instances `compile_decode_modules` compiles, matched on the class name's end:
# they carry no per-layer Python state (a decoder layer's `layer_idx` would make dynamo compile
# one graph per layer), so every instance shares the same compiled code.
FUSED_MODULES = ("RMSNorm", "MLP")


def compile_decode_modules(model: torch.nn.Module) -> int:
    """torch.compile the engine's own norm and MLP module instances (never their classes: the actor
    shares them), so each RMSNorm (float32 upcast, variance, rsqrt, scale) and each SwiGLU's
    activation-times-gate run as one fused kernel instead of several. The CUDA graphs of the static
    path then capture the compiled kernels. Graphs compile on first use per shape class (a static one,
    then one with a dynamic batch). Returns the number of module instances compiled."""
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith(FUSED_MODULES) and "Moe" not in name and hasattr(module, "compile"):
            module.compile()
            count += 1
    return count


class CompiledLayers:
    """Each decoder layer of the engine's model through torch.compile, for the decode step only: entering
    installs the compiled calls on the layers (never their class: the actor shares it), leaving removes them,
    so the prefill, whose `DynamicCache` state dynamo would guard on layer by layer, runs eagerly. A layer's
    graphs stop at `SlotCache.update` and go on after it, so RoPE, the residual adds, the norms and the
    SwiGLU fuse around the matrix products and no graph reads a layer index: the layers share their compiled
    code (graphs per shape class, not per layer). The static path's CUDA graphs capture the compiled kernels."""

    def __init__(self, model: torch.nn.Module) -> None:
        from train.parallel.parallelize import transformer_layers

        self.layers = transformer_layers(model)
        self.calls = [torch.compile(layer._call_impl, dynamic=True) for layer in self.layers]
        # The modules that hand their `layer_idx` to the cache, and that index as a CPU tensor: dynamo guards
        # on an int attribute's value (a recompile per layer, and eager once past its recompile limit), on a
        # tensor's shape and dtype only. SlotCache.update indexes its buffers with it as it would with the int.
        self.indexed = [(m, m.layer_idx, torch.tensor(m.layer_idx)) for layer in self.layers for m in layer.modules()
                        if type(getattr(m, "layer_idx", None)) is int]

    def __len__(self) -> int:
        return len(self.layers)

    def __enter__(self) -> CompiledLayers:
        for layer, call in zip(self.layers, self.calls):
            layer._compiled_call_impl = call
        for module, _, index in self.indexed:
            module.layer_idx = index
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer in self.layers:
            layer._compiled_call_impl = None
        for module, index, _ in self.indexed:
            module.layer_idx = index


def uncompile_modules(model: torch.nn.Module) -> None:
    """Undo `compile_decode_modules`: every module runs its eager forward again."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
