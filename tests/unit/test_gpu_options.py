"""GPU-path options on CPU: rollout.*/actor.use_liger_kernel config checks, engine arguments, and
the hf engine's device/dtype/push helpers. Tests that need CUDA are skipped here with the reason."""
from __future__ import annotations

import asyncio
import mmap
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import STUB_MODEL, compose_config
from train.engines.base import SamplingParams
from train.engines.hf import HFEngine, resolve_dtype, same_storage
from train.engines import engine_kwargs
from train.trainer.config import ConfigError, validate


def CUDA(test):
    """A test that needs a CUDA GPU: marked `gpu` (benchmarks/gpu_suite.py runs them) and skipped without one."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
    return pytest.mark.gpu(skip(test))


pytestmark = pytest.mark.usefixtures("in_repo_root")  # config paths are relative to the repo root


def test_defaults_are_valid_and_give_engine_arguments():
    cfg = compose_config()
    validate(cfg, world_size=2)
    ctx = SimpleNamespace(rank=1, world_size=2, local_rank=1, local_world_size=2, device=torch.device("cpu"))
    hf = engine_kwargs(cfg.rollout, ctx, model_path="m", tokenizer="tok", seed=42)
    assert hf == {"path": "m", "tokenizer": "tok", "device": torch.device("cpu"), "dtype": None,
                  "max_batch_size": cfg.rollout.max_batch_size, "static_cache": None, "compile_decode": None,
                  "compile_scope": "modules",
                  "prefill_chunk": 8192, "seed": 43, "lora": None}
    cfg = compose_config(["rollout.engine=sglang", "rollout.tp_size=2", "rollout.gpu_memory_utilization=0.6",
                "rollout.bucket_size_mb=256", "+rollout.sglang_kwargs.context_length=4096"])
    validate(cfg, world_size=2)
    sg = engine_kwargs(cfg.rollout, ctx, model_path="m", tokenizer="tok", seed=42)
    assert sg == {"model_path": "m", "rank": 1, "world_size": 2, "local_rank": 1, "local_world_size": 2,
                  "tp_size": 2, "gpu_memory_utilization": 0.6, "base_port": 30000, "bucket_size_mb": 256,
                  "dtype": "bfloat16", "seed": 42, "offload_weights": False,
                  "engine_kwargs": {"context_length": 4096}, "lora": None}


@pytest.mark.parametrize("overrides,pattern", [
    (["rollout.tp_size=2"], "rollout.tp_size.*needs the sglang engine"),
    (["rollout.engine=sglang", "rollout.tp_size=4"], "rollout.tp_size.*does not divide the 2 ranks"),
    (["rollout.tp_size=0"], "rollout.tp_size.*positive integer"),
    (["rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization.*\\(0, 1\\]"),
    (["rollout.gpu_memory_utilization=1.2"], "rollout.gpu_memory_utilization"),
    (["rollout.bucket_size_mb=0"], "rollout.bucket_size_mb"),
    (["rollout.base_port=80"], "rollout.base_port.*1024"),
    (["rollout.dtype=int8"], "rollout.dtype.*bfloat16"),
    (["rollout.sglang_kwargs=5"], "rollout.sglang_kwargs.*mapping"),
    (["actor.use_liger_kernel=yes"], "actor.use_liger_kernel.*true, false or null"),
    (["rollout.offload_weights=1"], "rollout.offload_weights.*true or false"),
    (["rollout.static_cache=auto"], "rollout.static_cache.*true, false or null"),
    (["rollout.sleep=sometimes"], "rollout.sleep.*true, false or null"),
])
def test_bad_gpu_keys_fail_with_the_key_name(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(compose_config(overrides), world_size=2)


def test_resolve_dtype_and_same_storage():
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype(None, "cuda:0") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="engine dtype"):
        resolve_dtype("int8", "cpu")
    a = torch.zeros(4, 3)
    assert same_storage(a, a) and same_storage(a, a.detach())
    assert not same_storage(a, a.clone()) and not same_storage(a, a.t()) and not same_storage(a, a.double())


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def generate(engine: HFEngine, prompts, n: int = 6):
    async def main():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0)) for p in prompts))

    return asyncio.run(main())


def test_push_of_shared_storage_copies_nothing_and_tokens_per_second():
    model = tiny()
    engine = HFEngine(model, eos_token_ids=[], copy_model=False)  # shares the trainer's tensors
    try:
        before = {n: t.data_ptr() for n, t in model.state_dict().items()}
        calls = []
        original = torch.Tensor.copy_

        def spy(self, src, *a, **k):
            calls.append(1)
            return original(self, src, *a, **k)

        torch.Tensor.copy_ = spy
        try:
            engine.update_weights(model.state_dict())
        finally:
            torch.Tensor.copy_ = original
        assert not calls and before == {n: t.data_ptr() for n, t in model.state_dict().items()}
        generate(engine, [[1, 2, 3], [4]])
        assert engine.tokens_per_second() > 0
        assert engine.stats["generated_tokens"] == 12
    finally:
        engine.close()


def test_from_pretrained_keeps_float32_on_cpu():
    engine = HFEngine.from_pretrained(str(STUB_MODEL))
    try:
        assert next(engine.model.parameters()).dtype == torch.float32
    finally:
        engine.close()


@CUDA
def test_cuda_engine_defaults_to_bfloat16():
    engine = HFEngine.from_pretrained(str(STUB_MODEL), device="cuda")
    try:
        assert next(engine.model.parameters()).dtype == torch.bfloat16
        generate(engine, [[5, 6, 7]])
    finally:
        engine.close()


@CUDA
def test_cuda_sleep_frees_memory_and_push_goes_straight_to_the_gpu():
    model = tiny()
    engine = HFEngine(model, eos_token_ids=[], device="cuda")
    try:
        want = generate(engine, [[1, 2, 3], [9, 9]])
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated()
        engine.sleep()
        assert torch.cuda.memory_allocated() < used
        assert all(not t.is_cuda for t in engine.model.state_dict().values())
        # in one page-locked slab of the weights' bytes (tied ones once), each rounded up to 512, in whole pages
        held = {id(t): t for t in [*engine.model.parameters(), *engine.model.buffers()]}.values()
        exact = sum(-(-t.numel() * t.element_size() // 512) * 512 for t in held)
        assert engine.host_bytes == -(-exact // mmap.PAGESIZE) * mmap.PAGESIZE
        hosts = list(engine.model.state_dict().values())
        assert all(t.is_pinned() for t in hosts)
        slab = {t.untyped_storage().data_ptr() for t in hosts}
        assert len(slab) == 1
        engine.wake()
        engine.sleep()  # the next sleep reuses the slab: no new registration
        assert {t.untyped_storage().data_ptr() for t in engine.model.state_dict().values()} == slab
        # Push half of the weights (from the GPU) while asleep: they land on the GPU, the rest waits.
        names = sorted(model.state_dict())[::2]
        engine.update_weights({n: model.state_dict()[n].cuda() for n in names})
        sd = engine.model.state_dict()
        assert all(sd[n].is_cuda for n in names)
        got = generate(engine, [[1, 2, 3], [9, 9]])  # wakes: the rest is uploaded
        assert all(t.is_cuda for t in engine.model.state_dict().values())
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
    finally:
        engine.close()
