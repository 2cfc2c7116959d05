"""Sizes users run: models built on the meta device and filled shard by shard, sharded DCP
checkpoints that reshard across layouts and world sizes, asynchronous saves and retention, kill
safety, the streamed Hugging Face export, and clear errors for checkpoints that do not fit."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from conftest import ROOT, STUB_MODEL, flat, kill_when, ranks_cmd, read_jsonl, run_torchrun, run_trainer, slow, tiny_model, trainer_env
from train.runtime.checkpoint import consolidate

SMALL = ["data.prompts_per_rollout=4", "data.responses_per_prompt=4", "rollout.dynamic_filtering=false",
         "trainer.test_freq=null", "trainer.log_samples=100"]


def dist_check(nproc: int, out, *args: str) -> dict | None:
    cmd = ranks_cmd(nproc, str(ROOT / "tests" / "dist_checks.py"), *args, "--out", str(out))
    proc = run_torchrun(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(out) if os.path.exists(out) and str(out).endswith(".pt") else None


# ------------------------------------------------------------------------------------------ loading


# One process, FSDP, TP and HSDP x TP on the stub (tied embeddings); TP on Qwen2 (biases, untied head)
# and Qwen3 (q/k norms), whose FSDP path is the stub's. All in the slow set: the default suite loads through
# the same path in tests/integration/test_model_families.py (Qwen3-MoE under FSDP2, Gemma 3 under TP).
@pytest.mark.parametrize("family,nproc,flags", [
    slow("llama", 1, []), slow("llama", 2, []), slow("llama", 2, ["--tp", "2"]), slow("llama", 4, ["--ddp", "2", "--tp", "2"]),
    slow("qwen2", 2, ["--tp", "2"]), slow("qwen3", 2, ["--tp", "2"]),
])
def test_meta_loading_equals_from_pretrained(tmp_path_factory, tmp_path, family, nproc, flags):
    """Actor and critic built on the meta device, laid out, then filled shard by shard: every weight
    and buffer (rotary frequencies) bit for bit what `from_pretrained` gives, tied embeddings tied,
    the critic's head at zero; logits and values bit for bit too where the math is the same (no TP)."""
    model = str(STUB_MODEL) if family == "llama" else tiny_model(tmp_path_factory, family)
    out = dist_check(nproc, tmp_path / "load.pt", "load", "--model", model, *flags)
    for role in ("actor", "critic"):
        assert out[role]["weights"] and all(out[role]["weights"].values()), (role, out[role]["weights"])
        assert out[role]["extra_keys"] == []
        assert out[role]["buffers"] and all(out[role]["buffers"].values()), (role, out[role]["buffers"])
    assert out["tied"]
    if "--tp" in flags:  # row-parallel matmuls add in another order
        assert out["logits_err"] < 1e-4 and out["values_err"] < 1e-4
    else:
        assert out["logits_equal"] and out["values_err"] == 0.0


# ------------------------------------------------------------------------------------------ resharding


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """4 steps on 2 ranks (fsdp=2), checkpoints at 2 and 4."""
    run = tmp_path_factory.mktemp("fsdp2_run")
    run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=4", "trainer.save_freq=2", *SMALL], nproc=2)
    return run


@pytest.mark.parametrize("nproc,flags", [slow(1, []), slow(4, []), (2, ["--tp", "2"])])
def test_a_checkpoint_reshards_to_another_world_size_or_layout(fsdp2_run, tmp_path, nproc, flags):
    """The fsdp=2 checkpoint loaded on 1 rank, on 4 ranks (fsdp=4), under tp=2 (DCP reshards), and
    saved again at once: model and Adam state equal to the saved ones."""
    dist_check(nproc, tmp_path / "out", "reshard", "--ckpt", str(fsdp2_run / "step2"), *flags)
    saved, again = consolidate(str(fsdp2_run / "step2")), consolidate(str(tmp_path / "step2"))
    a, b = flat(saved["actor"]), flat(again["actor"])
    assert a.keys() == b.keys() and any("exp_avg_sq" in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key], key
    if nproc == 4:  # the new save is sharded over the new world: one shard file per rank
        assert len(list((tmp_path / "step2" / "dcp").glob("__*_0.distcp"))) == 4


def test_resume_on_one_rank_takes_the_same_prompts(fsdp2_run, tmp_path):
    """The 2-rank run's step-2 checkpoint resumed on 1 rank: steps 3 and 4 train on the same prompts
    (the dataloader's position is global), none repeated or skipped."""
    run_trainer([f"trainer.save_dir={tmp_path}", "trainer.total_steps=4",
                 f"trainer.load_ckpt_from={fsdp2_run / 'step2'}", *SMALL], nproc=1)

    def prompts(run):
        out = {}
        for e in read_jsonl(run / "trajectories.jsonl"):
            if e["type"] == "sample":
                out.setdefault(e["step"], []).append(e["messages"][0]["content"])
        return {k: sorted(v) for k, v in out.items()}

    straight, resumed = prompts(fsdp2_run), prompts(tmp_path)
    assert sorted(resumed) == [3, 4] and resumed[3] == straight[3] and resumed[4] == straight[4]


# ------------------------------------------------------------------------------------------ async, retention, kill safety


def test_async_save_with_retention(fsdp2_run, tmp_path):
    """trainer.async_save with keep_last_n=2: shards written in the background, the two newest
    complete checkpoints kept, nothing half-written left; the step-4 checkpoint equals the
    synchronous run's."""
    run_trainer([f"trainer.save_dir={tmp_path}", "trainer.total_steps=4", "trainer.save_freq=1",
                 "trainer.async_save=true", "trainer.keep_last_n=2", *SMALL], nproc=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step")) == ["step3", "step4"]
    assert all((tmp_path / s / "COMPLETE").exists() for s in ("step3", "step4"))
    a, b = flat(consolidate(str(fsdp2_run / "step4"))["actor"]), flat(consolidate(str(tmp_path / "step4"))["actor"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                        for k in a)
    events = [e for e in read_jsonl(tmp_path / "trajectories.jsonl") if e["type"] == "checkpoint"]
    assert [e["step"] for e in events] == [1, 2, 3, 4] and all(e["async"] for e in events)


@pytest.mark.parametrize("async_save", [slow(False), True])
def test_sigkill_while_a_checkpoint_is_written_leaves_the_previous_one(fsdp2_run, tmp_path, async_save):
    """The run is killed (SIGKILL, every process) after the step-4 shards are written and before the
    checkpoint is marked complete: `latest` is step 2, the half-written step 4 is ignored, and
    resuming from `latest` ends exactly where the uninterrupted run did."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m",
           "train.trainer.grpo", "--config-name", "stub", "trainer.progress_bar=false", f"trainer.save_dir={run}",
           "trainer.total_steps=4", "trainer.save_freq=2", f"trainer.async_save={str(async_save).lower()}", *SMALL]
    env = {**trainer_env(), "INFINITE_RL_TEST_CHECKPOINT_DELAY_S": "3"}
    marker = run / "step4.tmp" / "dcp" / ".metadata"
    # killed once every shard of step 4 is on disk and before the completion marker is
    kill_when(cmd, run, marker.exists, "step 4's save", env=env)
    from train.runtime.checkpoint import find_latest

    assert find_latest(str(run)) == str(run / "step2")
    assert (run / "step4.tmp").exists() and not (run / "step4").exists()
    env.pop("INFINITE_RL_TEST_CHECKPOINT_DELAY_S")
    run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=4", "trainer.save_freq=2",
                 "trainer.load_ckpt_from=latest", f"trainer.async_save={str(async_save).lower()}", *SMALL], nproc=2)
    a, b = consolidate(str(fsdp2_run / "step4")), consolidate(str(run / "step4"))
    fa, fb = flat(a["actor"]), flat(b["actor"])
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) if isinstance(fa[k], torch.Tensor)
                                          else fa[k] == fb[k] for k in fa)
    assert a["trainer_state"]["dataloader"] == b["trainer_state"]["dataloader"]


# ------------------------------------------------------------------------------------------ export


def test_streamed_export_in_shards_with_the_critic(tmp_path):
    """latest/ in safetensors shards of at most trainer.export_shard_gb (tiny here: several shards
    and an index), loadable by from_pretrained, greedy-generating what the trained actor does; the
    critic under latest/critic/ as a token-classification model whose logits are the values."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=2", "trainer.save_freq=2", "algorithm=ppo",
                 "trainer.export_shard_gb=0.0002", *SMALL], nproc=2)
    latest = run / "latest"
    shards = sorted(latest.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and all(s.stat().st_size <= 0.0002 * 2**30 + 300_000 for s in shards)
    index = json.loads((latest / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    model = AutoModelForCausalLM.from_pretrained(latest)
    saved = consolidate(str(run / "step2"))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, saved["actor"]["model"][name], rtol=0, atol=0, msg=name)
    critic = AutoModelForTokenClassification.from_pretrained(latest / "critic")
    trained = saved["critic"]["model"]
    torch.testing.assert_close(critic.score.weight, trained["value_head.weight"], rtol=0, atol=0)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    values = critic(input_ids=ids).logits[0, :, 0]
    from train.models.value_model import ValueModel
    from transformers import AutoModel

    reference = ValueModel(AutoModel.from_pretrained(latest / "critic"))  # the backbone, then the trained head
    with torch.no_grad():
        reference.value_head.weight.copy_(trained["value_head.weight"])
        reference.value_head.bias.copy_(trained["value_head.bias"])
        torch.testing.assert_close(values, reference(ids, torch.ones_like(ids))[0], rtol=0, atol=1e-6)
    tok_ids = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=6, do_sample=False)
    assert tok_ids.shape[1] > 3


# ------------------------------------------------------------------------------------------ bad input


def test_checkpoints_that_do_not_fit_are_one_clear_line(fsdp2_run, tmp_path):
    incomplete = tmp_path / "step9"
    shutil.copytree(fsdp2_run / "step2", incomplete)
    (incomplete / "COMPLETE").unlink()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "COMPLETE").touch()
    other_model = tmp_path / "other_model"
    shutil.copytree(STUB_MODEL, other_model)
    config = json.loads((other_model / "config.json").read_text())
    config["intermediate_size"] = 256
    (other_model / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(other_model)).save_pretrained(other_model)
    # an incomplete or foreign folder is refused by the config check (in-process here; the launch path of a
    # ConfigError is one line, tests/integration/test_config.py); a checkpoint of another model at its load
    from conftest import compose_config
    from train.trainer.config import ConfigError, validate

    for folder, message in ((incomplete, "is not a complete checkpoint"), (foreign, "was not written by this trainer")):
        with pytest.raises(ConfigError, match=f"'{folder}' {message}"):
            validate(compose_config([f"trainer.load_ckpt_from={folder}", *SMALL], save_dir=str(tmp_path / "run")))
    cases = [([f"trainer.load_ckpt_from={fsdp2_run / 'step2'}", f"actor.model_name={other_model}"],
              f"'{fsdp2_run / 'step2'}' does not fit this model: 'actor.model.model.layers.0.mlp.gate_proj.weight' is "
              "(352, 128) there and (256, 128) here")]
    for overrides, message in cases:
        before = sorted(os.listdir(fsdp2_run))
        proc = run_trainer([f"trainer.save_dir={tmp_path / 'run'}", *overrides, *SMALL], nproc=1, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
        assert sorted(os.listdir(fsdp2_run)) == before  # nothing overwritten
