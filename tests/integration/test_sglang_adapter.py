"""The `sglang` rollout engine adapter, without SGLang installed (it cannot be, on these machines).

- A RECORDING FAKE engine (tests/fake_sglang.py, not SGLang) checks the adapter's call sequence
  (drain -> release -> resume weights -> begin -> buckets -> end -> one flush -> resume the rest),
  bucket contents, result parsing, and the owner/feeder forwarding with tp_size=2 (torchrun, gloo).
- The real SGLang wheel (pinned in requirements-gpu.txt) is downloaded once into .cache/sglang/ and
  read with `ast`, never imported: every method and keyword the adapter was seen calling on the fake
  must exist with that signature in the real source; so must the ServerArgs fields, sampling
  parameters, memory tags, helper classes and payload keys it relies on.
None of this runs a model under SGLang: that path is untested here (docs/gpu.md).
"""
from __future__ import annotations

import ast
import contextlib
import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator

import pytest
import torch

from conftest import ROOT, run_torchrun, trainer_env
from fake_sglang import EOS, RecordingFakeSGLangEngine, expected_tokens, fake_bindings
from dataclasses import asdict

from train.engines.base import SamplingParams, sampling_from_mapping
from train.utils.image_inputs import ImageInputs
from train.engines.sglang import (
    ALL_TAGS,
    SGLANG_SAMPLING_KEYS,
    _sampling_from_json,
    SGLangEngine,
    engine_init_kwargs,
    prepare_env,
    rollout_group,
    rollout_groups,
    to_generation,
    to_sglang_sampling,
)
from train.models.lora import LoraSettings

CACHE = ROOT / ".cache" / "sglang"


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    # The owner sets these for SGLang (prepare_env); monkeypatch restores them after each test.
    monkeypatch.setenv("SGLANG_BLOCK_NONZERO_RANK_CHILDREN", "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


# ---------------------------------------------------------------------------------------- pure parts


def test_rollout_groups_owner_and_feeders() -> None:
    assert rollout_groups(8, 2, 8) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert rollout_groups(4, 1, 4) == [(0,), (1,), (2,), (3,)]
    g = rollout_group(5, 8, 4, 8)
    assert (g.members, g.owner, g.is_owner, g.tp_rank) == ((4, 5, 6, 7), 4, False, 1)
    assert rollout_group(4, 8, 4, 8).is_owner
    # 2 nodes x 4 GPUs, tp 4: one group per node.
    assert rollout_groups(8, 4, 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    with pytest.raises(ValueError, match="divide the number of ranks"):
        rollout_groups(6, 4, 6)
    with pytest.raises(ValueError, match="inside one node"):
        rollout_groups(8, 8, 4)
    with pytest.raises(ValueError, match=">= 1"):
        rollout_groups(2, 0, 2)


def test_prepare_env_for_torchrun() -> None:
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "OTHER": "1"}
    prepare_env(env)
    assert env == {"OTHER": "1", "SGLANG_BLOCK_NONZERO_RANK_CHILDREN": "0"}


def test_engine_init_kwargs() -> None:
    kw = engine_init_kwargs("m", tp_size=2, gpu_memory_utilization=0.4, port=30003, base_gpu_id=2,
                            dtype="bfloat16", seed=7, extra={"context_length": 4096})
    assert kw["mem_fraction_static"] == 0.4 and kw["enable_memory_saver"] is True
    assert kw["port"] == 30003 and kw["base_gpu_id"] == 2 and kw["context_length"] == 4096


def test_sampling_params_conversion() -> None:
    p = to_sglang_sampling(SamplingParams(max_new_tokens=9, temperature=0.0, top_p=0.9, top_k=5, stop=("\n\n",)))
    assert p == {"max_new_tokens": 9, "temperature": 0.0, "top_p": 0.9, "top_k": 5, "min_p": 0.0,
                 "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False,
                 "skip_special_tokens": False, "no_stop_trim": True, "stop": ["\n\n"]}
    assert "stop" not in to_sglang_sampling(SamplingParams())
    # the whole set, and SGLang's own keys passed through (sampling_from_mapping puts them in `extra`)
    sp = sampling_from_mapping({"top_k": 0, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [7],
                                "ignore_eos": True, "regex": "[0-9]+", "min_new_tokens": 2}, SGLANG_SAMPLING_KEYS)
    p = to_sglang_sampling(sp)
    assert (p["top_k"], p["min_p"], p["repetition_penalty"], p["stop_token_ids"], p["ignore_eos"]) == \
        (-1, 0.05, 1.1, [7], True)
    assert p["regex"] == "[0-9]+" and p["min_new_tokens"] == 2
    assert _sampling_from_json(json.loads(json.dumps(asdict(sp)))) == sp  # the feeder -> owner wire format


def test_result_parsing_finish_reasons_and_trimming() -> None:
    def out(n: int, reason) -> dict:
        return {"meta_info": {"output_token_logprobs": [(-0.1 * i, 10 + i, None) for i in range(n)],
                              "finish_reason": reason}}

    g = to_generation(out(3, {"type": "stop", "matched": 12}), 8, 4)
    assert (g.token_ids, g.finish_reason, g.extra["prompt_tokens"]) == ([10, 11, 12], "stop", 4)
    assert g.logprobs == pytest.approx([0.0, -0.1, -0.2])
    assert to_generation(out(8, {"type": "length", "length": 8}), 8, 1).finish_reason == "length"
    assert to_generation(out(2, {"type": "abort", "message": "x"}), 8, 1).finish_reason == "abort"
    assert to_generation(out(2, None), 8, 1).finish_reason == "abort"
    assert to_generation(out(2, "stop"), 8, 1).finish_reason == "stop"
    trimmed = to_generation(out(11, {"type": "stop"}), 8, 1)  # more tokens than asked for
    assert (len(trimmed.token_ids), len(trimmed.logprobs), trimmed.finish_reason) == (8, 8, "length")
    with pytest.raises(RuntimeError, match="return_logprob"):
        to_generation({"meta_info": {"finish_reason": {"type": "stop"}}}, 8, 1)


def test_nothing_imports_sglang_unless_asked() -> None:
    code = ("import sys, train.engines, train.engines.sglang, train.engines.weight_buckets, train.engines.hf\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'sglang'], 'sglang imported'\n"
            "from train.engines import make_engine\n"
            "try:\n    make_engine('sglang', model_path='x')\nexcept ImportError as e:\n"
            "    assert 'requirements-gpu.txt' in str(e), e\n    print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=trainer_env(), capture_output=True, text=True,
                          timeout=120)
    if "ok" not in proc.stdout and "sglang" in sys.modules:
        pytest.skip("sglang is installed here")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------- fake engine, tp_size=1


def small_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),  # 8 KiB fp32
        "model.layers.0.mlp.weight": torch.randn(40, 32, generator=g),
        "model.layers.0.norm.weight": torch.randn(32, generator=g),
        "model.layers.0.scale": torch.randn(16, generator=g).to(torch.bfloat16),
        "model.step": torch.tensor([3, 4], dtype=torch.int64),
        "lm_head.weight": torch.randn(128, 64, generator=g),  # 32 KiB: above the cap, alone
    }


CAP_BYTES = 10 * 1024


@contextlib.contextmanager
def fake_engine(calls: list, offload_weights: bool = False, lora=None,
                **options) -> Iterator[tuple[SGLangEngine, RecordingFakeSGLangEngine]]:
    """The adapter over a recording fake (appending to `calls`), closed when the block ends."""
    bindings, engines = fake_bindings(calls, **options)
    engine = SGLangEngine("fake/model", bindings=bindings, device="cpu", bucket_size_mb=CAP_BYTES / 2**20,
                          gpu_memory_utilization=0.3, base_port=31000, seed=5, offload_weights=offload_weights,
                          lora=lora)
    try:
        yield engine, engines[0]
    finally:
        engine.close()


def generate_all(engine: SGLangEngine, prompts: list[list[int]], sp: SamplingParams):
    async def main():
        return await asyncio.gather(*(engine.generate(p, sp) for p in prompts))

    return asyncio.run(main())  # a fresh loop, like RolloutWorker's own: not the engine's loop


PROMPTS = [[3, 4, 5], [7], [2, 2, 2, 2, 9]]


def test_generation_through_the_engine_loop() -> None:
    calls: list = []
    with fake_engine(calls) as (engine, fake):
        sp = SamplingParams(max_new_tokens=6, temperature=0.7)
        gens = generate_all(engine, PROMPTS, sp)
        for p, g in zip(PROMPTS, gens):
            want = expected_tokens(p, 6, version=0)
            assert g.token_ids == want
            assert len(g.logprobs) == len(want)
            assert g.finish_reason == ("stop" if want[-1] == EOS else "length")
        init = calls[0]
        assert init[0] == "__init__"
        assert init[1]["mem_fraction_static"] == 0.3 and init[1]["enable_memory_saver"] is True
        assert init[1]["port"] == 31000 and init[1]["tp_size"] == 1
        gen_calls = [kw for name, kw in calls if name == "async_generate"]
        assert len(gen_calls) == 3 and all(kw["return_logprob"] is True for kw in gen_calls)
        assert gen_calls[0]["input_ids"] in PROMPTS
        assert engine.stats["requests"] == 3
    assert calls[-1][0] == "shutdown"


def test_throughput_counters_cover_this_ranks_requests() -> None:
    """`rollout/tokens_per_s` on SGLang: generated tokens and the wall time during which any of this
    rank's requests was in flight (the RECORDING FAKE takes `delay_s` per request, all concurrent)."""
    import time as _time

    calls: list = []
    with fake_engine(calls, delay_s=0.2) as (engine, _):
        start = _time.perf_counter()
        gens = generate_all(engine, PROMPTS, SamplingParams(max_new_tokens=6))
        wall = _time.perf_counter() - start
        assert engine.stats["generated_tokens"] == sum(len(g.token_ids) for g in gens) > 0
        # the three requests overlap: busy about one delay, not three
        assert 0.2 <= engine.stats["generation_seconds"] <= wall < 0.55
        generate_all(engine, PROMPTS[:1], SamplingParams(max_new_tokens=6))
        assert engine.stats["requests"] == 4 and engine.stats["generation_seconds"] >= 0.4


def test_trims_to_max_new_tokens() -> None:
    calls: list = []
    with fake_engine(calls, overshoot=5) as (engine, _):
        [g] = generate_all(engine, [[10]], SamplingParams(max_new_tokens=4))
        assert len(g.token_ids) == 4 and g.finish_reason == "length"


def push_sequence(calls: list) -> list[str]:
    return [name for name, _ in calls if name not in ("__init__", "async_generate")]


def test_sleep_push_flush_resume_sequence_and_bucket_contents() -> None:
    calls: list = []
    with fake_engine(calls, offload_weights=True) as (engine, fake):
        generate_all(engine, PROMPTS, SamplingParams(max_new_tokens=5))
        engine.sleep()
        assert fake.released == set(ALL_TAGS)
        assert fake.kwargs["enable_weights_cpu_backup"] is True  # a wake without a push stays correct
        model = small_model()
        engine.update_weights(iter(model.items()))
        seq = push_sequence(calls)
        n = len(fake.buckets)
        assert seq == (["release_memory_occupation", "resume_memory_occupation", "begin_weight_update"]
                       + ["update_weights_from_tensor"] * n
                       + ["end_weight_update", "flush_cache", "resume_memory_occupation"])
        resumes = [kw["tags"] for name, kw in calls if name == "resume_memory_occupation"]
        assert resumes == [["weights"], ["kv_cache", "cuda_graph"]]  # weights before the push, the rest after
        assert not fake.released
        for name, kw in calls:
            if name == "update_weights_from_tensor":
                assert kw["load_format"] == "flattened_bucket" and kw["flush_cache"] is False
                assert len(kw["named_tensors"]) == 1  # one payload per TP rank
        # Every parameter exactly once, cast to the engine dtype (bf16) if floating point.
        names = [n for b in fake.buckets for n in b]
        assert sorted(names) == sorted(model)
        for name, t in model.items():
            want = t.to(torch.bfloat16) if t.is_floating_point() else t
            assert fake.loaded[name].dtype == want.dtype and torch.equal(fake.loaded[name], want), name
        assert all(len(d) == 1 for d in fake.bucket_dtypes)
        for names_, size in zip(fake.buckets, fake.bucket_bytes):
            assert size <= CAP_BYTES or len(names_) == 1
        assert engine.stats["buckets"] == n and engine.stats["pushes"] == 1
        # New weights serve the next requests (the fake bumps its version at end_weight_update).
        [g] = generate_all(engine, [PROMPTS[0]], SamplingParams(max_new_tokens=5))
        assert g.token_ids == expected_tokens(PROMPTS[0], 5, version=1)


def test_default_sleep_keeps_the_weights() -> None:
    calls: list = []
    with fake_engine(calls) as (engine, fake):
        engine.sleep()
        assert fake.released == {"kv_cache", "cuda_graph"} and "enable_weights_cpu_backup" not in fake.kwargs
        engine.update_weights(small_model())
        assert push_sequence(calls)[:2] == ["release_memory_occupation", "begin_weight_update"]
        assert push_sequence(calls)[-3:] == ["end_weight_update", "flush_cache", "resume_memory_occupation"]
        assert calls[-1][1]["tags"] == ["kv_cache", "cuda_graph"] and not fake.released


def test_push_without_sleep_and_wake() -> None:
    calls: list = []
    with fake_engine(calls) as (engine, fake):
        engine.update_weights(small_model())  # a Mapping works too
        assert push_sequence(calls)[0] == "begin_weight_update"
        assert push_sequence(calls)[-2:] == ["end_weight_update", "flush_cache"]
        assert "resume_memory_occupation" not in push_sequence(calls)
        engine.sleep()
        engine.sleep()  # idempotent: one release
        engine.wake()
        engine.wake()
        assert [n for n in push_sequence(calls) if "memory" in n] == ["release_memory_occupation",
                                                                    "resume_memory_occupation"]
        assert not fake.released
        generate_all(engine, [[1, 2]], SamplingParams(max_new_tokens=3))


def test_generating_while_asleep_is_a_clear_error() -> None:
    calls: list = []
    with fake_engine(calls) as (engine, _):
        engine.sleep()
        with pytest.raises(RuntimeError, match="asleep"):
            generate_all(engine, [[1]], SamplingParams(max_new_tokens=2))
        engine.wake()
        generate_all(engine, [[1]], SamplingParams(max_new_tokens=2))


def test_push_drains_in_flight_requests_first() -> None:
    calls: list = []
    with fake_engine(calls, delay_s=0.4) as (engine, fake):
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(g=generate_all(engine, [[5, 6]], SamplingParams(max_new_tokens=3))))
        thread.start()
        while not any(name == "async_generate" for name, _ in calls):
            time.sleep(0.01)
        engine.update_weights(small_model())  # the fake refuses loads or flushes under a running request
        thread.join()
        assert result["g"][0].token_ids == expected_tokens([5, 6], 3, version=0)
        gen_done = fake.inflight == 0
        assert gen_done


def test_a_failed_load_raises_with_the_reason() -> None:
    calls: list = []
    with fake_engine(calls) as (engine, fake):
        fake.tp_size = 2  # the fake now expects two payloads: the load fails
        with pytest.raises(RuntimeError, match="expected 2 flattened_bucket payloads"):
            engine.update_weights(small_model())


def test_bad_options_fail_early() -> None:
    bindings, _ = fake_bindings([])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        SGLangEngine("m", bindings=bindings, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="bucket_size_mb"):
        SGLangEngine("m", bindings=bindings, bucket_size_mb=0)
    with pytest.raises(ValueError, match="dtype"):
        SGLangEngine("m", bindings=bindings, dtype="int8")


# ---------------------------------------------------------------------------------------- tp_size=2, two processes


def test_tp2_owner_serves_feeder_and_push_gathers_every_rank(tmp_path) -> None:
    """torchrun, 2 ranks, gloo: rank 0 owns the (fake) engine, rank 1 forwards its prompts; rank 0
    calls sleep() while rank 1 is still generating; the push all-gathers DTensor shards on both
    ranks and hands SGLang one payload per TP rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           str(ROOT / "tests" / "sglang_dist_check.py"), "--out", str(tmp_path)]
    proc = run_torchrun(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    for r in (r0, r1):
        assert r["before"] == r["want_before"] and r["after"] == r["want_after"]
    assert r0["is_owner"] and not r1["is_owner"]
    assert r0["engines_built"] == 1 and r1["engines_built"] == 0  # only the owner builds an engine
    assert r0["sequence"][0] == "release_memory_occupation" and r0["sequence"][-3:] == ["flush_cache",
                                                                                     "resume_memory_occupation",
                                                                                     "shutdown"]
    assert r0["payloads_per_call"] and set(r0["payloads_per_call"]) == {2}
    assert sorted(r0["loaded_names"]) == sorted(r0["model_names"]) and r0["loaded_equal"]
    assert r0["requests_served"] == 2 * r0["prompts_per_rank"]  # the feeder's requests ran on the owner


# ---------------------------------------------------------------------------------------- the real wheel's source


def pinned_version() -> str:
    text = (ROOT / "requirements-gpu.txt").read_text()
    m = re.search(r"^sglang==([\w.]+)", text, re.M)
    assert m, "requirements-gpu.txt must pin sglang==<version> (the adapter is checked against it)"
    return m.group(1)


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    version = pinned_version()
    found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    if not found:
        if not pypi_reachable():
            pytest.skip(f"PyPI unreachable and no cached sglang {version} wheel in {CACHE}")
        CACHE.mkdir(parents=True, exist_ok=True)
        # The wheel is cp311/manylinux only: ask for that platform explicitly so this works anywhere.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.11", "--platform", "manylinux_2_34_x86_64", f"sglang=={version}", "-d", str(CACHE)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    assert found, f"no sglang {version} wheel in {CACHE}"
    return zipfile.ZipFile(found[0])


def parse(wheel: zipfile.ZipFile, path: str) -> ast.Module:
    return ast.parse(wheel.read(path).decode())


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def accepts(fn: ast.FunctionDef | ast.AsyncFunctionDef, keywords: set[str]) -> set[str]:
    """The keywords `fn` would reject."""
    a = fn.args
    if a.kwarg is not None:
        return set()
    static = any(getattr(d, "id", None) == "staticmethod" for d in fn.decorator_list)
    skip = set() if static else {(a.posonlyargs + a.args)[0].arg}  # self / cls
    names = {x.arg for x in a.args if x.arg not in skip} | {x.arg for x in a.kwonlyargs}
    return keywords - names


def struct_fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def server_args_fields(wheel: zipfile.ZipFile) -> set[str]:
    """ServerArgs' fields: its own annotations (a dataclass in older releases) plus, since the
    0.5.2x refactor, the fields of the namespaces listed in `_INPUT_NAMESPACES`."""
    tree = parse(wheel, "sglang/srt/server_args.py")
    fields = struct_fields(find_class(tree, "ServerArgs"))
    spaces: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_INPUT_NAMESPACES" for t in node.targets):
            spaces = [e.id for e in node.value.elts]
    for path in wheel.namelist():
        if spaces and path.startswith("sglang/srt/arg_groups/fields/") and path.endswith(".py"):
            for node in ast.walk(parse(wheel, path)):
                if isinstance(node, ast.ClassDef) and node.name in spaces:
                    fields |= struct_fields(node)
    return fields


def recorded_calls() -> list[tuple[str, dict]]:
    """Drive the adapter through everything it does and return what it called on the engine."""
    calls: list = []
    with fake_engine(calls, offload_weights=True) as (engine, _):
        generate_all(engine, PROMPTS, SamplingParams(max_new_tokens=4, top_p=0.9, top_k=3, stop=("x",),
                                                     stop_token_ids=(5,), min_p=0.1, repetition_penalty=1.2,
                                                     extra=tuple((k, None) for k in SGLANG_SAMPLING_KEYS)))
        engine.sleep()
        engine.update_weights(small_model())
        engine.sleep()
        engine.wake()
    with fake_engine(calls) as (engine, _):  # a vision-language prompt: its pictures as processor output
        prompt, images = picture_prompt()
        asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=2), images=images))
    with fake_engine(calls, lora=LoraSettings(4, 8.0)) as (engine, _):  # LoRA: adapters pushed, then named
        engine.update_weights(adapters(0))
        engine.sleep()
        engine.update_weights(adapters(1))
        generate_all(engine, PROMPTS[:1], SamplingParams(max_new_tokens=3))
    return calls


def picture_prompt() -> tuple[list[int], list[ImageInputs]]:
    """A prompt holding two pictures' placeholder runs (id 9: 4 and 2 tokens) and their processed images."""
    images = [ImageInputs(torch.full((16, 1176), float(k)), torch.tensor(grid), n, f"d{k}")
              for k, (grid, n) in enumerate((([1, 4, 4], 4), ([1, 2, 4], 2)))]
    return [3, 8, 9, 9, 9, 9, 7, 5, 8, 9, 9, 7, 4], images


def test_pictures_travel_as_processor_output_with_the_prompt() -> None:
    calls: list = []
    prompt, images = picture_prompt()
    images[1] = ImageInputs(torch.ones(8, 1176), torch.tensor([1, 2, 4]), 2, "d1")
    with fake_engine(calls) as (engine, _):
        gen = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=3), images=images))
        plain = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=3)))
    assert gen.token_ids == plain.token_ids == expected_tokens(prompt, 3, version=0)  # (the fake reads ids only)
    with_images, without = [kw for name, kw in calls if name == "async_generate"]
    assert "image_data" not in without and with_images["input_ids"] == prompt
    [data] = with_images["image_data"]
    assert data["format"] == "processor_output" and data["input_ids"].tolist() == [prompt]
    assert data["pixel_values"].shape == (24, 1176) and data["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]
    assert torch.equal(data["pixel_values"][16:], torch.ones(8, 1176))


def adapters(seed: int) -> dict[str, torch.Tensor]:
    """LoRA matrices of two projections, as the trainer names them."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.0.self_attn.{p}.lora_{m}.default.weight": torch.randn(shape, generator=g)
            for p in ("q_proj", "v_proj") for m, shape in (("A", (4, 8)), ("B", (8, 4)))}


def test_a_lora_push_loads_a_new_adapter_that_requests_then_name() -> None:
    """With LoRA the engine starts with room for one adapter; each push loads the adapters under a new
    name (peft's tensor names and config), unloads the previous one and flushes the cache; requests
    run on the base before the first push and name the newest adapter after it."""
    calls: list = []
    with fake_engine(calls, lora=LoraSettings(4, 8.0, target_modules=("q_proj", "v_proj"))) as (engine, fake):
        init = dict(calls[0][1])
        assert init["enable_lora"] is True and init["max_lora_rank"] == 4 and init["max_loras_per_batch"] == 1
        assert init["lora_target_modules"] == ["q_proj", "v_proj"]
        [before] = generate_all(engine, PROMPTS[:1], SamplingParams(max_new_tokens=4))
        assert before.token_ids == expected_tokens(PROMPTS[0], 4, version=0)
        engine.update_weights(adapters(0))
        first = {k: v.clone() for k, v in adapters(0).items()}
        loaded = fake.adapters["policy-1"]
        assert set(loaded) == {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
                               "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
                               "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"}
        assert torch.equal(loaded["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                           first["model.layers.0.self_attn.q_proj.lora_A.default.weight"].to(engine.dtype))
        engine.update_weights(adapters(1))
        assert list(fake.adapters) == ["policy-2"]  # the old adapter is gone
        names = [n for n, _ in calls]
        load = [kw for n, kw in calls if n == "load_lora_adapter_from_tensors"]
        assert load[0]["config_dict"]["r"] == 4 and load[0]["config_dict"]["lora_alpha"] == 8.0
        assert load[0]["config_dict"]["target_modules"] == ["q_proj", "v_proj"]
        second = names.index("load_lora_adapter_from_tensors", names.index("load_lora_adapter_from_tensors") + 1)
        assert names[second + 1:second + 3] == ["unload_lora_adapter", "flush_cache"]
        [after] = generate_all(engine, PROMPTS[:1], SamplingParams(max_new_tokens=4))
        assert [kw.get("lora_path") for n, kw in calls if n == "async_generate"] == [None, "policy-2"]
        assert after.token_ids == expected_tokens(PROMPTS[0], 4, version=2)
        assert "update_weights_from_tensor" not in names  # not one base tensor travels


def test_adapter_calls_match_the_real_sglang_source(wheel: zipfile.ZipFile) -> None:
    engine_tree = parse(wheel, "sglang/srt/entrypoints/engine.py")
    engine_cls = methods(find_class(engine_tree, "Engine"))
    fields = server_args_fields(wheel)
    sampling_fields = struct_fields(find_class(parse(wheel, "sglang/srt/sampling/sampling_params.py"),
                                               "SamplingParams"))
    calls = recorded_calls()
    used = {name for name, _ in calls}
    assert {"__init__", "async_generate", "update_weights_from_tensor", "flush_cache", "begin_weight_update",
            "end_weight_update", "release_memory_occupation", "resume_memory_occupation", "shutdown",
            "load_lora_adapter_from_tensors", "unload_lora_adapter"} <= used

    for name, kwargs in calls:
        if name == "__init__":
            assert engine_cls["__init__"].args.kwarg is not None  # Engine(**kwargs) -> ServerArgs(**kwargs)
            assert not set(kwargs) - fields, f"not ServerArgs fields: {set(kwargs) - fields}"
            continue
        assert name in engine_cls, f"sglang Engine has no method {name}"
        fn = engine_cls[name]
        assert not accepts(fn, set(kwargs)), f"Engine.{name} rejects {accepts(fn, set(kwargs))}"
        # The adapter awaits async_generate and calls everything else synchronously.
        assert isinstance(fn, ast.AsyncFunctionDef) == (name == "async_generate"), name
        if name == "async_generate":
            assert not set(kwargs["sampling_params"]) - sampling_fields
    # Engine keeps the loop its synchronous methods run (the adapter runs it in a thread between them).
    init_src = ast.unparse(engine_cls["__init__"])
    assert "self.loop = " in init_src
    assert "self.loop.run_until_complete" in ast.unparse(engine_cls["flush_cache"])


def test_helpers_tags_and_payload_format_exist_in_the_real_source(wheel: zipfile.ZipFile) -> None:
    bucket = find_class(parse(wheel, "sglang/srt/weight_sync/tensor_bucket.py"), "FlattenedTensorBucket")
    m = methods(bucket)
    assert not accepts(m["__init__"], {"named_tensors"})
    assert {"get_flattened_tensor", "get_metadata"} <= set(m)
    common = wheel.read("sglang/srt/utils/common.py").decode()
    serializer = methods(find_class(ast.parse(common), "MultiprocessingSerializer"))
    assert not accepts(serializer["serialize"], {"obj", "output_str"})
    # The scheduler's safe unpickler must accept the bucket metadata class.
    assert '("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")' in common
    assert "from sglang.srt.utils.common import *" in wheel.read("sglang/srt/utils/__init__.py").decode()
    assert "__all__" not in common or "MultiprocessingSerializer" in common.split("__all__", 1)[1]
    patch = parse(wheel, "sglang/srt/utils/patch_torch.py")
    assert any(isinstance(n, ast.FunctionDef) and n.name == "monkey_patch_torch_reductions" for n in patch.body)
    constants = wheel.read("sglang/srt/constants.py").decode()
    for tag in ALL_TAGS:
        assert f'"{tag}"' in constants, tag
    # The payload dict keys the model runner reads for load_format="flattened_bucket".
    updater = next(p for p in wheel.namelist() if p.endswith("model_runner_components/weight_updater.py"))
    src = wheel.read(updater).decode()
    assert '"flattened_bucket"' in src and '["flattened_tensor"]' in src and '["metadata"]' in src
    # Result fields the adapter parses, and the finish reason types it maps.
    tm = wheel.read("sglang/srt/managers/tokenizer_manager.py").decode()
    assert '"output_token_logprobs"' in tm and '"finish_reason"' in tm
    # Image data in the Hugging Face processor's output format (format="processor_output": pixel_values and
    # image_grid_thw with the caller's input_ids), read by the multimodal processors.
    processors = [p for p in wheel.namelist() if p.startswith("sglang/srt/multimodal/processors/") and p.endswith(".py")]
    base = wheel.read(next(p for p in processors if p.endswith("base_processor.py"))).decode()
    assert "processor_output" in base and "image_grid_thw" in wheel.read(
        next(p for p in processors if p.endswith("qwen_vl.py"))).decode()
    sb = wheel.read("sglang/srt/managers/schedule_batch.py").decode()
    for kind in ("stop", "length", "abort"):
        assert f'"type": "{kind}"' in sb, kind
