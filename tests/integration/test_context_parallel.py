"""Context parallelism (actor.cp_size / critic.cp_size: zigzag chunks, ring attention; train/parallel/seq_parallel.py)
against one process: the ring's attention and its gradients against a float64 softmax over the whole packed row,
and the trainer's gradients, clip norm and updated weights on packed, multi-turn, shared-prompt batches."""
import pytest
import torch

from conftest import assert_same_update, launch_check as launch, slow
from train.parallel.ring_attention import RING_TILE


@pytest.mark.parametrize("nproc,flags", [pytest.param(2, ["--share"], id="cp2-shared-prompts"),
                                         slow(2, [], id="cp2"), slow(4, ["--share"], id="cp4-shared-prompts")])
def test_ring_attention_is_a_float64_softmax_over_the_whole_row(tmp_path, nproc, flags):
    """Grouped-query heads, with and without a sliding window, whole blocks and tiles of 8 (some masked out),
    the fused CPU kernel and plain torch; each rank's outputs and q/k/v gradients."""
    launch(nproc, tmp_path / "ring.pt", "ring", *flags)
    for rank in range(nproc):
        result = torch.load(tmp_path / f"ring.rank{rank}.pt")
        assert result["shared"] == ("--share" in flags)
        for window in (None, 7):
            for case in (f"{window}_{tile}_{kernel}" for tile in (RING_TILE, 8)
                         for kernel in ("PlainKernel", "FlashCPUKernel")):
                for name in ("out", "dq", "dk", "dv"):
                    assert result[f"{name}_{case}"] < 1e-12 * max(result[f"scale_{case}"], 1.0), (rank, name, case)
            assert result[f"segment_{window}"] < 1e-5  # the one-process path (float32 softmax) agrees to its rounding


# (mode, processes, flags): Ulysses inside the ring (cp2 x sp2), the ring inside tensor parallelism (cp2 x tp2:
# each tp rank's heads go round their own ring), the ring alone (cp2 on 2 ranks; with the fused log-prob head), with
# data parallelism beside it (4 ranks: dp 2), cp4
LAYOUTS = [pytest.param("grads", 4, ["--cp", "2", "--sp", "2", "--share", "--ac"], id="actor-cp2xsp2-shared-checkpointing"),
           slow("grads", 4, ["--cp", "2", "--tp", "2", "--share", "--ac"], id="actor-cp2xtp2-shared-checkpointing"),
           slow("grads", 2, ["--cp", "2", "--share", "--ac"], id="actor-cp2-shared-checkpointing"),
           slow("grads", 2, ["--cp", "2", "--share", "--fused_head"], id="actor-cp2-shared-fused-head"),
           slow("grads", 2, ["--cp", "2"], id="actor-cp2"), slow("grads", 4, ["--cp", "4"], id="actor-cp4"),
           slow("grads", 4, ["--cp", "2", "--share"], id="actor-cp2-dp2-shared"),
           slow("critic_grads", 2, ["--cp", "2", "--share"], id="critic-cp2-shared")]


@pytest.mark.parametrize("mode,nproc,flags", LAYOUTS)
def test_context_parallel_gradients_and_step_equal_one_process(tmp_path, mode, nproc, flags):
    """Grouped samples (GRPO groups sharing prompts, a tool reply inside a response, uneven lengths), the
    uneven split of samples over ranks."""
    one = launch(1, tmp_path / "one.pt", mode, "--grouped", "--max_tokens", "200", "--clip", "0.05")
    cp = launch(nproc, tmp_path / "cp.pt", mode, "--grouped", "--max_tokens", "64", "--clip", "0.05", *flags)
    assert_same_update(one, cp)
    assert cp["fused_head"] == ("--fused_head" in flags)  # actor.use_liger_kernel: log-probs from the fused head


@pytest.mark.parametrize("resume", [False, slow(True, id="resumed")])
def test_a_cp_run_trains_with_the_samplers_logprobs_and_resumes_exactly(tmp_path, resume):
    """2 ranks, cp 2, the stub model: the trainer's log-probs under ring attention are the engine's (fp32); the
    step-2 checkpoint resumed gives step 3's loss bit for bit."""
    from conftest import read_jsonl, run_trainer

    steps = 3 if resume else 2
    common = ["actor.cp_size=2", "actor.share_prompt=true", "trainer.test_freq=null", f"trainer.total_steps={steps}",
              "data.prompts_per_rollout=4", "data.responses_per_prompt=4"]
    straight = tmp_path / "straight"
    run_trainer([f"trainer.save_dir={straight}", "trainer.save_freq=2", *common], nproc=2)
    rows = read_jsonl(straight / "metrics.jsonl")
    assert len(rows) == steps and all(r["actor/sampler_kl"] < 1e-4 and r["actor/grad_norm"] > 0 for r in rows), rows
    if not resume:
        return
    resumed = tmp_path / "resumed"
    run_trainer([f"trainer.save_dir={resumed}", f"trainer.load_ckpt_from={straight / 'step2'}", *common], nproc=2)
    [again] = read_jsonl(resumed / "metrics.jsonl")
    assert again["step"] == 3 and again["actor/loss"] == rows[2]["actor/loss"]


@pytest.mark.slow  # ~3 min on 2 cores: the update's ring attention over 4 rows of 17K tokens in plain torch
def test_a_conversation_past_16k_tokens_trains_with_cp_and_the_samplers_logprobs(tmp_path):
    """tests/envs/long_context.py pastes ~5,600-token logs into three turns: each conversation ends past 16K tokens
    (the stub's weights under a config with 32K positions),
    the engine prefills the long prompts in chunks (rollout.prefill_chunk), and with cp 2 each rank lays out half of
    every packed row. The trainer's log-probs at the end of the conversation equal the sampler's (fp32), and the
    step updates."""
    import json
    import shutil

    from conftest import ROOT, read_jsonl, run_trainer

    model = tmp_path / "stub_32k"  # the stub with room for the positions (RoPE: the same weights)
    shutil.copytree(ROOT / "stub" / "model", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    from transformers import AutoTokenizer

    # a turn ends at its first digit (a turn cut by max_new_tokens would end the episode): turns of a few tokens
    digits = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(list("0123456789"))
    run = tmp_path / "long"
    run_trainer([f"trainer.save_dir={run}", f"actor.model_name={model}", "actor.cp_size=2",
                 f"rollout.train_sampling_params.stop_token_ids=[{','.join(map(str, digits))}]", "trainer.test_freq=null", "trainer.total_steps=1",
                 "data.prompts_per_rollout=2", "data.responses_per_prompt=2", "rollout.dynamic_filtering=false",
                 f"rollout.env_path={ROOT / 'tests' / 'envs' / 'long_context.py'}", "rollout.max_turns=4",
                 "rollout.max_total_length=20000", "rollout.prefill_chunk=4096", "actor.max_length_per_device=20480",
                 "rollout.train_sampling_params.max_new_tokens=12"], nproc=2, timeout=900)
    [row] = read_jsonl(run / "metrics.jsonl")
    assert row["trajectory_length/train"] > 16384 and row["n_turns/train"] == 4, row
    assert row["actor/sampler_kl"] < 1e-4 and row["actor/grad_norm"] > 0, row
