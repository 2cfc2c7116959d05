"""The hf engine's static-cache decoding (train/engines/static_decode.py) against its dynamic path.

On CPU the static path runs without CUDA graphs (`static_cache=True`), so the buffers, masks,
column writes, row buckets and compaction are checked here against the `DynamicCache` path on the
same requests: the same tokens and the same log-probs. On a GPU the same comparison runs with the
graphs captured and replayed (marked `gpu`)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from train.engines.base import SamplingParams
from train.engines.hf import HFEngine
from train.engines.static_decode import COLUMN_BLOCK, column_bucket, row_bucket, supports_static_decode

VOCAB = 100


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharp logits: no near-ties between the two paths
    return model


def qwen2(seed: int = 0, layers: int = 3) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
    return model


def deepseek_mla(seed: int = 0):
    """Multi-head latent attention (DeepSeek-V3's layout): keys wider than values (qk_head_dim 24, v_head_dim 8)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                              topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=8, head_dim=8, max_position_embeddings=512)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def requests(seed: int = 1) -> list[tuple[list[int], SamplingParams]]:
    """Groups sharing a prompt (shared prefill), ragged prompt lengths (left padding), budgets from
    3 to 40 tokens and an EOS token, so rows finish at many different steps (compaction), greedy,
    seeded and sampled rows, top-p/top-k and a repetition penalty."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(9):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        for j in range(4):
            sp = SamplingParams(max_new_tokens=3 + (7 * i + 5 * j) % 38, temperature=(0.0 if i % 3 == 0 else 1.0),
                                top_p=0.9 if i == 4 else 1.0, top_k=20 if i == 5 else 0,
                                repetition_penalty=1.3 if i == 7 else 1.0, seed=100 * i + j if i % 2 else None)
            out.append((prompt, sp))
    return out


def generate(engine: HFEngine, reqs):
    async def main():
        return await asyncio.gather(*(engine.generate(p, sp) for p, sp in reqs))

    return asyncio.run(main())


def compare(model, device: str = "cpu", rounds: int = 2, compile_decode: bool = False):
    dynamic = HFEngine(model, eos_token_ids=[2], device=device, static_cache=False, seed=5)
    static = HFEngine(model, eos_token_ids=[2], device=device, static_cache=True, seed=5, compile_decode=compile_decode)
    assert static.static_cache and not dynamic.static_cache
    for r in range(rounds):  # the second round reuses the decoder's buffers (and graphs on GPU)
        reqs = requests(seed=r + 1)
        want, got = generate(dynamic, reqs), generate(static, reqs)
        assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=2e-4)
        assert {len(g.token_ids) for g in got} >= {3, 10}  # rows really finished at different steps
    assert static.stats["static_batches"] == rounds and dynamic.stats["static_batches"] == 0
    return static


@pytest.mark.parametrize("make", [llama, qwen2, deepseek_mla], ids=["llama", "qwen2-gqa-tied", "deepseek-mla"])
def test_static_decoding_matches_the_dynamic_path_on_cpu(make) -> None:
    engine = compare(make())
    decoder = engine._static
    assert decoder is not None and decoder.compactions > 0  # finished rows were moved out
    assert engine.stats["cuda_graphs"] == 0  # no graphs on CPU
    assert decoder.rows == row_bucket(36) and decoder.columns % COLUMN_BLOCK == 0
    # each buffer has the heads and width of what its layer caches (latent attention caches keys and values of
    # different widths)
    with torch.no_grad():
        cache = engine.model(torch.tensor([[5, 6, 7]]), use_cache=True).past_key_values
    assert [(k.shape[1], k.shape[3], v.shape[1], v.shape[3]) for k, v in zip(decoder.keys, decoder.values)] == [
        (layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[1], layer.values.shape[3])
        for layer in cache.layers]


def test_rows_past_the_live_ones_start_each_batch_at_position_zero() -> None:
    """A bucket's rows past the live ones are computed and ignored; their positions restart with every batch
    (else they grow without bound across batches: an absolute-position table's end, a dynamic RoPE's scale)."""
    engine = HFEngine(llama(), eos_token_ids=[2], static_cache=True)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    generate(engine, [([5, 6, 7], sp)] * 3)  # 3 live rows in a bucket of 4
    decoder = engine._static
    assert decoder.rows == 4 and int(decoder.positions[3]) == 19  # the spare row stepped with the others
    generate(engine, [([5, 6], sp)] * 3)
    assert engine._static is decoder and int(decoder.positions[3]) == 19  # from 0 again, not 38


def test_buckets() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 64, 65, 256)] == [1, 2, 4, 4, 8, 64, 128, 256]
    assert column_bucket(1) == COLUMN_BLOCK and column_bucket(COLUMN_BLOCK + 1) == 2 * COLUMN_BLOCK
    assert column_bucket(COLUMN_BLOCK + 1, limit=COLUMN_BLOCK + 7) == COLUMN_BLOCK + 7


def test_static_decoding_is_off_on_cpu_by_default_and_for_sliding_window_models() -> None:
    assert not HFEngine(llama(), eos_token_ids=[2]).static_cache  # CPU default: the dynamic path
    assert supports_static_decode(llama())
    torch.manual_seed(0)
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                           sliding_window=8, max_window_layers=0))
    assert not supports_static_decode(sliding)
    assert not HFEngine(sliding, eos_token_ids=[2], static_cache=True).static_cache


def test_a_weight_push_keeps_the_decoder_and_a_moved_weight_drops_it() -> None:
    model = llama()
    engine = HFEngine(model, eos_token_ids=[2], static_cache=True)
    reqs = requests()[:8]
    generate(engine, reqs)
    first = engine._static
    engine.update_weights({n: p.detach() * 0.5 for n, p in model.named_parameters()})  # copies in place
    generate(engine, reqs)
    assert engine._static is first
    with torch.no_grad():
        layer = engine.model.model.layers[0].mlp.up_proj
        layer.weight.data = layer.weight.data.clone()  # new storage: captured graphs would read the old
    generate(engine, reqs)
    assert engine._static is not first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("make", [llama, qwen2], ids=["llama", "qwen2-gqa-tied"])
@pytest.mark.parametrize("compile_decode", [False, True], ids=["eager-modules", "compiled-modules"])
def test_cuda_graph_decoding_matches_the_dynamic_path(make, compile_decode) -> None:
    # float32 weights: the two paths agree to rounding; compiled modules are captured in the graphs
    engine = compare(make(), device="cuda", compile_decode=compile_decode)
    assert engine.static_error is None and engine.stats["cuda_graphs"] > 0
    assert engine.compile_error is None and (engine.stats["compiled_modules"] > 0) == compile_decode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_graphs_are_captured_while_another_thread_allocates() -> None:
    """An asynchronous rollout (or the Tinker service) captures on the engine's thread while the trainer's thread
    allocates and frees device memory: the capture is thread-local, so neither fails."""
    import threading

    stop, errors = threading.Event(), []

    def trainer() -> None:
        try:
            while not stop.is_set():
                x = torch.empty(1 << 26, device="cuda")  # 256 MiB: a fresh cudaMalloc after the cache is emptied
                del x
                torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        engine = compare(llama(), device="cuda")
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors and engine.static_error is None and engine.stats["cuda_graphs"] > 0


@pytest.mark.slow  # ~20 s of inductor C++ builds; on CUDA, where compile_decode is on by default, the gpu test above
def test_compiled_decode_modules_match_the_dynamic_path_on_cpu() -> None:
    """rollout.compile_decode: the engine's norm and MLP instances run through inductor (C++ on CPU)
    and the static path samples the same tokens, with log-probs to rounding. Only the engine's own
    module instances are compiled: another model of the same classes stays eager."""
    engine = compare(qwen2(), rounds=1, compile_decode=True)
    assert engine.compile_error is None
    assert engine.stats["compiled_modules"] == 3 * 3 + 1  # per layer two norms and the MLP; the final norm
    other = qwen2()
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in other.modules())


def test_compiled_decoder_layers_sample_what_the_eager_path_does_with_graphs_shared_by_all_layers() -> None:
    """compile_scope="layers": each whole decoder layer through inductor (C++ on CPU) for the static path's
    decode steps: the same tokens as the dynamic path, log-probs to rounding. No graph reads a layer index,
    so a model with 3x the layers compiles no more graphs (else: one per layer, and eager past dynamo's
    recompile limit), and the prefill and the module's own class stay eager."""
    def graphs(layers: int) -> tuple[HFEngine, int]:
        torch._dynamo.reset()  # no code compiled before (reset leaves the counters: cleared too)
        torch._dynamo.utils.counters.clear()
        # no EOS: rows finish at their budgets, so both models decode the same sequence of shapes
        engine = HFEngine(qwen2(layers=layers), eos_token_ids=[], static_cache=True, seed=5, compile_decode=True,
                          compile_scope="layers")
        reqs = requests()[:12]
        want = generate(HFEngine(qwen2(layers=layers), eos_token_ids=[], seed=5), reqs)
        got = generate(engine, reqs)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=2e-4)
        assert engine.compile_error is None and engine.stats["compiled_modules"] == layers
        return engine, int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    engine, two = graphs(2)
    _, six = graphs(6)
    assert 0 < two == six, (two, six)
    # outside the decode steps the layers run their eager forward, with their int layer index
    layer = engine.model.model.layers[1]
    assert layer._compiled_call_impl is None and layer.self_attn.layer_idx == 1
    torch._dynamo.reset()


def test_a_compile_that_fails_falls_back_to_the_eager_modules() -> None:
    model = llama()
    engine = HFEngine(model, eos_token_ids=[2], static_cache=True, seed=5, compile_decode=True)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    for module in engine.model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = broken
    reqs = requests()[:8]
    got = generate(engine, reqs)
    want = generate(HFEngine(model, eos_token_ids=[2], static_cache=True, seed=5), reqs)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert "no C++ compiler found" in engine.compile_error and engine.stats["compiled_modules"] == 0


def test_running_out_of_memory_is_not_taken_for_a_failed_compile() -> None:
    """An out-of-memory error in a compiled decode is raised as it is: compiling stays on (eager modules would
    need as much memory), and no compile error is recorded."""
    engine = HFEngine(llama(), eos_token_ids=[2], static_cache=True, seed=5, compile_decode=True)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine._decode_in_parts = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        engine._generate_batch(requests()[:2])
    assert engine.compile_error is None and engine.stats["compiled_modules"] > 0


def test_grouped_decode_attention_against_a_float64_reference() -> None:
    """One-token queries, 6 query heads over 2 key/value heads, an additive padding mask: each query
    head h attends with key/value head h // 3, as softmax(q k^T * scale + mask) v."""
    from train.engines.static_decode import grouped_decode_attention

    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, length, dim = 3, 6, 2, 9, 8
    q, k, v = (torch.randn(*shape, generator=g) for shape in
               ((b, heads, 1, dim), (b, kv_heads, length, dim), (b, kv_heads, length, dim)))
    mask = torch.zeros(b, 1, 1, length)
    mask[0, ..., :4] = torch.finfo(torch.float32).min  # row 0: four padding columns
    out, _ = grouped_decode_attention(torch.nn.Module(), q, k, v, mask, scaling=0.3)
    assert out.shape == (b, 1, heads, dim)  # transformers' layout: [batch, query, heads, dim]
    for row in range(b):
        for h in range(heads):
            kh = h // (heads // kv_heads)
            scores = (k[row, kh].double() @ q[row, h, 0].double()) * 0.3 + mask[row, 0, 0].double()
            want = torch.softmax(scores, dim=0) @ v[row, kh].double()
            torch.testing.assert_close(out[row, 0, h].double(), want, rtol=0, atol=1e-5)


def test_the_static_engine_uses_grouped_decode_attention() -> None:
    from train.engines.static_decode import DECODE_ATTENTION

    engine = HFEngine(llama(), eos_token_ids=[2], static_cache=True)
    assert engine.model.config._attn_implementation == DECODE_ATTENTION
    assert HFEngine(llama(), eos_token_ids=[2]).model.config._attn_implementation == "sdpa"


def test_a_batch_larger_than_the_memory_limit_is_decoded_in_parts() -> None:
    """With room for 8 rows of this batch's columns, 36 requests are decoded as 8 + 8 + 8 + 8 + 4;
    seeded and greedy rows sample the same tokens as one dynamic batch. With room for no row at all,
    the dynamic path decodes them."""
    from train.engines.static_decode import kv_bytes_per_token

    model = llama()
    reqs = [(p, SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                               top_k=sp.top_k, repetition_penalty=sp.repetition_penalty,
                               seed=sp.seed if sp.seed is not None else (None if sp.temperature == 0 else 7 + i)))
            for i, (p, sp) in enumerate(requests())]
    row = COLUMN_BLOCK * kv_bytes_per_token(model.config, torch.float32)  # every request fits one block
    want = generate(HFEngine(model, eos_token_ids=[2], static_cache=False), reqs)
    parts = HFEngine(model, eos_token_ids=[2], static_cache=True, static_cache_max_bytes=8 * row + row // 2)
    got = generate(parts, reqs)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=2e-4)
    assert parts.stats["static_parts"] == 5 and parts._static.rows == 8
    none_fit = HFEngine(model, eos_token_ids=[2], static_cache=True, static_cache_max_bytes=row // 2)
    assert [g.token_ids for g in generate(none_fit, reqs)] == [w.token_ids for w in want]
    assert none_fit.stats["static_batches"] == 0 and none_fit._static is None


def test_static_decoding_of_a_lora_engine_matches_the_dynamic_path() -> None:
    """The engine of a LoRA run holds peft layers (train/models/lora.py); with nonzero adapters the
    static path samples what the dynamic one does."""
    from train.models.lora import LoraSettings, apply_lora

    model = llama()
    apply_lora(model, LoraSettings(rank=4, alpha=8.0))
    with torch.no_grad():
        for name, value in model.named_parameters():
            if ".lora_B." in name:
                value.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    compare(model, rounds=1)
