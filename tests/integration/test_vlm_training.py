"""Vision-language policies trained end to end (docs/vision.md): pictures in prompts and in tool replies go
through the trainer's RolloutWorker and hf engine, are dispatched with their samples and packed with their
multimodal rotary positions; the trainer's log-probs equal the sampler's, placeholder tokens are never
actions, FSDP2 on two ranks gives one process's update, a shared prompt's picture laid out once gives the
unshared update, a picture that cannot be decoded is that sample's env error, and a run resumes exactly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_same_update, launch_check, load_file, run_trainer

build = load_file(ROOT / "stub" / "build_vlm_stub.py")


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_vlm")
    build.save_random_model(folder)
    return folder


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    """Where the first launch saves its rollouts: the other launches train on exactly those samples (the engine's
    batches form as requests arrive, and a different batch shape may round a sampled token's way)."""
    return tmp_path_factory.mktemp("vision_samples") / "samples.pt"


@pytest.fixture(scope="module")
def one_process(vlm_folder, samples, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vision") / "one.pt"
    return launch_check(1, out, "vision", "--model", str(vlm_folder), "--max_tokens", "512", "--samples", str(samples))


def test_sampler_and_trainer_logprobs_agree_with_pictures_in_prompts_and_tool_replies(one_process):
    r = one_process
    assert max(r["images"]) == 2 and min(r["images"]) == 1  # the prompt's picture, and the tool's when it answered
    assert max(r["turns"]) == 2
    assert r["placeholders"] == r["image_tokens"]  # every image's tokens are in the ids, once
    assert r["placeholder_actions"] == 0  # and never trained on
    assert r["max_diff"] < 5e-6 and abs(r["kl"]) < 1e-6  # float32 rounding (measured: 9.5e-7 and 4e-8)


@pytest.fixture(scope="module")
def frozen(vlm_folder, samples, one_process, tmp_path_factory) -> dict:
    """One launch for two checks: actor.freeze_vision's update, and the critic's values."""
    return launch_check(1, tmp_path_factory.mktemp("frozen") / "frozen.pt", "vision", "--model", str(vlm_folder),
                        "--max_tokens", "512", "--freeze", "--critic", "--samples", str(samples))


def test_the_critic_sees_the_pictures_as_the_models_own_forward_does(frozen):
    """PPO's critic (adv.estimator=gae) over the packed batch with its pixels = transformers' Qwen2.5-VL backbone on
    each sample alone (SDPA), under the same random value head."""
    assert frozen["critic_diff"] < 1e-5  # relative to the values' scale (measured 5.5e-7)


def test_a_picture_that_cannot_be_decoded_is_that_samples_env_error(one_process):
    errors = one_process["errors"]
    broken = [e for e in errors if e]
    assert len(broken) == 3 and all("the env's reply in turn 1" in e and "cannot be decoded" in e for e in broken)
    assert errors[:9] == [None] * 9  # the other rows' samples went on


def test_fsdp2_on_two_ranks_gives_the_one_process_update(one_process, vlm_folder, samples, tmp_path):
    two = launch_check(2, tmp_path / "two.pt", "vision", "--model", str(vlm_folder), "--max_tokens", "512",
                       "--samples", str(samples))
    assert any("visual" in name for name in two["grads"])  # the vision tower trains (actor.freeze_vision=false)
    assert_same_update(one_process, two)


def test_a_shared_prompts_picture_laid_out_once_gives_the_unshared_update(one_process, vlm_folder, samples, tmp_path):
    shared = launch_check(1, tmp_path / "shared.pt", "vision", "--model", str(vlm_folder), "--max_tokens", "512",
                          "--share", "--samples", str(samples))
    assert_same_update(one_process, shared)


def test_freeze_vision_keeps_the_tower_and_trains_the_rest(one_process, vlm_folder, frozen):
    from safetensors.torch import load_file as load_tensors

    initial = {"model." + k: v for k, v in load_tensors(str(vlm_folder / "model.safetensors")).items()
               if k.startswith("visual.")}  # the Hub layout's `visual.` is the model's `model.visual.`
    tower = [n for n in frozen["weights"] if n.startswith("model.visual.")]
    assert tower and sorted(tower) == sorted(initial) and not frozen["frozen_grads"]
    assert not any(n in frozen["grads"] for n in tower)  # no gradient, no optimizer state
    for name in tower:  # the step left it as loaded
        assert torch.equal(frozen["weights"][name], initial[name]), name
    text = [n for n in frozen["grads"] if "language_model" in n]
    assert text
    for name in text:  # the language model's gradients are the unfrozen run's
        torch.testing.assert_close(frozen["grads"][name], one_process["grads"][name], rtol=0,
                                   atol=1e-5 * float(one_process["grads"][name].abs().max()))


def _vlm_run(folder: Path, save: Path, steps: int, extra: list[str] = ()) -> list[dict]:
    run_trainer([f"actor.model_name={folder}", f"trainer.save_dir={save}", f"trainer.total_steps={steps}",
                 "data.prompts_per_rollout=8", "data.responses_per_prompt=4", "trainer.test_freq=null",
                 "rollout.train_sampling_params.temperature=0.5",  # sampled near the greedy 0.17: rewards differ
                 "trainer.save_freq=1", "rollout.dynamic_filtering=false", *extra],
                config="vlm_stub")
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def test_a_vlm_run_resumes_bit_exactly_and_exports_a_folder_that_loads(tmp_path):
    """The bundled warm-started stub: 2 steps straight = 1 + resume + 1."""
    from safetensors.torch import load_file as load_tensors
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    folder = ROOT / "stub" / "vlm_model"
    straight = _vlm_run(folder, tmp_path / "straight", 2)
    _vlm_run(folder, tmp_path / "split", 1)
    _vlm_run(folder, tmp_path / "split", 2, ["trainer.load_ckpt_from=latest"])
    assert len(straight) == 2 and any(m.get("actor/grad_norm", 0) > 0 for m in straight)  # it trained
    a, b = (load_tensors(str(p / "latest" / "model.safetensors")) for p in (tmp_path / "straight", tmp_path / "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "straight" / "latest")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    Qwen2VLImageProcessorPil.from_pretrained(tmp_path / "straight" / "latest")  # saved beside it


def test_train_serve_answers_chat_requests_with_image_parts(tmp_path):
    """The bundled VLM served by `python -m train.serve`, driven by the official openai client: an image_url part
    is read (greedy answers equal the engine's own on the same picture), a file URL is refused with a 400."""
    import asyncio
    import sys

    import openai

    from conftest import free_port, running
    from train.datasets.tokenize import prompt_ids
    from train.datasets.vision import VisionProcessor
    from train.engines.base import SamplingParams
    from train.engines.hf import HFEngine

    row = json.loads((ROOT / "stub" / "data" / "vision" / "test.jsonl").read_text().splitlines()[0])
    url = row["messages"][1]["content"][0]["image"]
    question = row["messages"][1]["content"][1]["text"]
    port = free_port()
    cmd = [sys.executable, "-m", "train.serve", "--model", "stub/vlm_model", "--port", str(port)]
    with running(cmd, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log"):
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused") as client:
            messages = [{"role": "system", "content": row["messages"][0]["content"]},
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": question}]}]
            got = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)
            with pytest.raises(openai.BadRequestError, match="data: URLs"):
                client.chat.completions.create(model="default", max_tokens=2, messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}])
    engine = HFEngine.from_pretrained("stub/vlm_model")
    try:
        vision = VisionProcessor.from_pretrained("stub/vlm_model", engine.tokenizer, engine.model.config)
        shown, images = vision.prepare(row["messages"])
        gen = asyncio.run(engine.generate(prompt_ids(engine.tokenizer, shown), SamplingParams(temperature=0.0,
                                                                                              max_new_tokens=4),
                                          images=images))
    finally:
        engine.close()
    assert got.choices[0].message.content == engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    assert got.usage.prompt_tokens == len(prompt_ids(engine.tokenizer, shown)) > 4  # the image's tokens counted


@pytest.mark.parametrize("overrides,world,pattern", [
    (["actor.sp_size=2"], 2, r"actor.sp_size=2: Qwen2_5_VLConfig is a vision-language model.*set actor.sp_size=1"),
    (["actor.tp_size=2"], 2, r"actor.tp_size=2: .*FSDP / HSDP \(data parallel\) only"),
    (["actor.cp_size=2"], 2, r"actor.cp_size=2: .*placeholder tokens must stay whole"),
    (["rollout.engine=sglang", "rollout.tp_size=2"], 2, r"rollout.tp_size.*not forwarded.*rollout.tp_size=1"),
    (["actor.use_liger_kernel=true"], 1, r"actor.use_liger_kernel.*vision tower"),
    (["actor.model_name=stub/model", "actor.freeze_vision=true"], 1, r"actor.freeze_vision.*has no vision tower"),
])
def test_unsupported_vision_combinations_are_config_errors_naming_the_key(overrides, world, pattern):
    from conftest import compose_config
    from train.trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match=pattern):
        validate(compose_config(overrides, name="vlm_stub"), world)


def test_the_vlm_config_is_valid_with_sglang_on_one_rank_and_critic():
    from conftest import compose_config
    from train.trainer.config import validate

    validate(compose_config(["rollout.engine=sglang", "adv.estimator=gae", "actor.freeze_vision=true"],
                            name="vlm_stub"), 2)


def test_a_pack_without_a_picture_still_runs_the_tower_with_the_other_ranks(vlm_folder, tmp_path):
    """Text-only rows among picture rows, one sample per pack: the ranks' packs in lockstep hold a picture on one
    rank and none on the other. FSDP gathers the vision tower's shards in each forward that runs it, so a pack
    without a picture carries a blank one-token image in a segment of its own (no loss), else the ranks'
    collectives part ways (a run died with mismatched all-gathers). Two ranks give one process's update."""
    samples = tmp_path / "mixed_samples.pt"
    args = ("vision", "--model", str(vlm_folder), "--max_tokens", "40", "--mixed", "--samples", str(samples))
    one = launch_check(1, tmp_path / "one.pt", *args)
    assert 0 in one["images"] and max(one["images"]) > 0  # samples with and without pictures
    two = launch_check(2, tmp_path / "two.pt", *args)
    assert_same_update(one, two)
