"""Expert parallelism (actor.ep_size, train/parallel/expert_parallel.py) against one process running the model's
own expert loop: the same gradients (expert weights included), global clip norm and updated weights for the same
rollout data, in every layout ep composes with; an ep rank no token goes to; the experts loaded block by block."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_same_update, launch_check as launch, slow
from model_families import build


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    return build("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


# (processes, flags): ep2 on 2 ranks holds each expert once (efsdp = 1); on 4 ranks FSDP shards each ep block
# again (efsdp = 2), with replicas (ddp), or with Ulysses and activation checkpointing (the all-to-alls recomputed).
# ep2 on 2 ranks is slow: the default suite's test_an_ep_rank_that_no_token_is_routed_to_still_joins_the_backward
# compares every gradient with one process on that layout too (two experts per layer hit, two not).
LAYOUTS = [slow(2, ["--ep", "2"], id="ep2"),
           slow(4, ["--ep", "2"], id="ep2-efsdp2"), slow(4, ["--ep", "4"], id="ep4"),
           slow(4, ["--ep", "2", "--ddp", "2"], id="ep2-ddp2"), slow(4, ["--ep", "2", "--sp", "2", "--ac"], id="ep2-sp2-ac")]


@pytest.mark.parametrize("nproc,flags", LAYOUTS)
def test_expert_parallel_gradients_and_step_equal_one_process(tmp_path, moe, nproc, flags):
    one = launch(1, tmp_path / "one.pt", "grads", "--model", moe, "--max_tokens", "200", "--clip", "0.05")
    ep = launch(nproc, tmp_path / "ep.pt", "grads", "--model", moe, "--max_tokens", "64", "--clip", "0.05", *flags)
    experts = [name for name in one["grads"] if ".experts." in name]
    assert experts and all(float(one["grads"][name].abs().max()) > 0 for name in experts)
    assert_same_update(one, ep, all_learn=False)


def test_an_ep_rank_that_no_token_is_routed_to_still_joins_the_backward(tmp_path):
    """Every router scores every expert the same, so top-2 of 4 picks the same two experts for every token: the
    other ep rank receives no row. Its backward must still run both all-to-alls and reduce its experts' (zero)
    gradients, or the ranks wait on each other forever (a hang the timeout turns into a failure)."""
    folder = build("qwen3_moe", tmp_path / "tied")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    model.save_pretrained(folder)
    one = launch(1, tmp_path / "one.pt", "grads", "--model", folder, "--max_tokens", "200", "--clip", "0.05")
    ep = launch(2, tmp_path / "ep.pt", "grads", "--model", folder, "--max_tokens", "64", "--clip", "0.05",
                "--ep", "2", timeout=120)
    for layer in range(2):  # one ep rank's two experts got no token, the other's both
        grad = one["grads"][f"model.layers.{layer}.mlp.experts.down_proj"]
        hit = [bool(grad[e].abs().max() > 0) for e in range(4)]
        assert hit in ([True, True, False, False], [False, False, True, True]), hit
    assert_same_update(one, ep, all_learn=False)


@pytest.mark.slow
def test_experts_split_over_ep_and_fsdp_load_block_by_block_like_from_pretrained(tmp_path, moe):
    """4 ranks, ep 2: each rank holds one expert of four (FSDP over an ep block: a strided placement), read
    from the files as that block alone; weights and logits bit for bit those of from_pretrained."""
    result = launch(4, tmp_path / "load.pt", "load", "--model", moe, "--ep", "2")
    for role in ("actor", "critic"):
        assert result[role]["weights"] and all(result[role]["weights"].values()), result[role]["weights"]
        assert result[role]["extra_keys"] == [] and all(result[role]["buffers"].values())
    assert result["logits_equal"] and result["values_err"] == 0.0


@pytest.mark.slow
def test_an_ep_run_resumes_exactly_and_its_checkpoint_loads_without_ep(tmp_path, moe):
    """2 ranks, ep 2: the step-2 checkpoint (experts saved as whole [E, ...] tensors) resumed under ep 2 gives step
    3's loss bit for bit; resumed with the experts FSDP-sharded instead (ep 1), the same loss up to summation order."""
    from conftest import read_jsonl, run_trainer

    env = tmp_path / "parity.py"
    env.write_text('def reward_fn(messages, answer):\n    return float(sum(map(ord, messages[-1]["content"])) % 2)\n')
    common = [f"actor.model_name={moe}", f"rollout.env_path={env}", "data.prompts_per_rollout=2",
              "data.responses_per_prompt=4", "rollout.dynamic_filtering=false", "trainer.test_freq=null",
              "actor.router_replay=response", "trainer.total_steps=3"]
    straight = tmp_path / "straight"
    run_trainer([f"trainer.save_dir={straight}", "trainer.save_freq=2", "actor.ep_size=2", *common], nproc=2)
    before = {m["step"]: m for m in read_jsonl(straight / "metrics.jsonl")}[3]
    for ep in (2, 1):
        resumed = tmp_path / f"resumed_ep{ep}"
        run_trainer([f"trainer.save_dir={resumed}", f"trainer.load_ckpt_from={straight / 'step2'}",
                     f"actor.ep_size={ep}", *common], nproc=2)
        [again] = read_jsonl(resumed / "metrics.jsonl")
        assert again["step"] == 3
        if ep == 2:
            assert again["actor/loss"] == before["actor/loss"]
        else:
            assert again["actor/loss"] == pytest.approx(before["actor/loss"], rel=1e-4, abs=1e-6)
