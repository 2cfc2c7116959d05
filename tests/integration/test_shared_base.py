"""rollout.share_actor_base (issue 36): with LoRA, the engine's base weights are the actor's own tensors
(train/models/shared_base.py). Checked on one rank with the actor in float32 (a plain module), in bfloat16 with
fp32 masters (a plain bf16 module) and under FSDP2 (one-rank DTensors): the borrowed tensors' data pointers are the
actor's, building the engine does not grow the process by a model's size, a push moves adapter bytes only, the
engine samples what an engine with its own copy samples, and a trainer run is the same with and without sharing.
A full fine-tune with masters lends the engine all its bf16 weights."""
import shutil

import pytest
import torch

from conftest import ROOT, compose_config, read_jsonl, run_trainer, slow
from test_distributed import launch
from train.models.lora import is_adapter
from train.trainer.config import ConfigError, validate


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    """A random Qwen3 of ~16M parameters (64 MiB in float32) with the stub's tokenizer: large enough for
    a model's worth of memory to stand out from the allocator's noise."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=8192, hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (ROOT / "stub" / "model" / name).exists():
            shutil.copy(ROOT / "stub" / "model" / name, folder / name)
    return folder


@pytest.mark.parametrize("dtype,masters", [("bfloat16", "true"), slow("bfloat16", "false"), slow("float32", "false")])
def test_the_engine_borrows_the_actors_base_and_samples_like_its_own_copy(tmp_path, qwen3_folder, dtype, masters):
    """bf16 with fp32 masters (a plain module, the default on one process), bf16 under FSDP2 over one rank
    (DTensors), float32."""
    out = launch(1, tmp_path / "shared.pt", "shared_base", "--model", str(qwen3_folder), "--dtype", dtype,
                 "--masters", masters)
    assert out["engine_dtype"] == f"torch.{dtype}"
    assert sorted(out["borrowed"]) == sorted(out["base_names"]) and out["same_storage"]
    # the process grew by the engine's own copy (~64 MiB in float32) for one, not for the other
    assert out["grown_own_mib"] > 0.7 * out["model_mib"], out
    assert out["grown_shared_mib"] < 0.2 * out["model_mib"], out
    names = [n for n, _ in out["pushed"]]
    assert names and all(is_adapter(n) for n in names) and sorted(names) == sorted(out["adapter_names"])
    assert out["tokens"][0] == out["tokens"][1]
    for got, want in zip(*out["logprobs"]):
        # the same weights bit for bit; a float32 matmul over another buffer may round its last bit differently
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
    assert out["kept_on_sleep"] and out["base_unchanged"]
    assert "borrows" in out["refused"] and "rollout.share_actor_base" in out["refused"]


def runs_by_share(tmp_path, common: list[str], shares: tuple[str, ...]) -> tuple[dict, dict]:
    """A stub run per rollout.share_actor_base value: its metrics rows without the clocks, and its output."""
    rows, out = {}, {}
    for share in shares:
        proc = run_trainer([f"trainer.save_dir={tmp_path / share}", f"rollout.share_actor_base={share}", *common])
        out[share] = proc.stdout + proc.stderr
        rows[share] = [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and "per_s" not in k}
                       for r in read_jsonl(tmp_path / share / "metrics.jsonl")]
    return rows, out


@pytest.mark.slow  # the engine-level equality above (default) samples the same tokens from the borrowed base
def test_a_lora_run_is_the_same_with_and_without_a_shared_base(tmp_path):
    """Two stub runs with LoRA, the engine over the actor's base and an engine with its own copy: the
    same samples, rewards and losses at both steps (the second after a push; metrics equal but for the
    timings)."""
    common = ["trainer.total_steps=2", "trainer.test_freq=null", "trainer.save_freq=null", "actor.lora.rank=4",
              "actor.lora.alpha=8", "actor.lr=1e-3"]
    rows, out = runs_by_share(tmp_path, common, ("true", "false"))
    assert len(rows["true"]) == 2 and rows["true"] == rows["false"]
    assert "uses the actor's frozen base" in out["true"] and "uses the actor's frozen base" not in out["false"]


def test_a_full_fine_tune_with_masters_lends_the_engine_its_bf16_weights(tmp_path):
    """One process in bf16 without LoRA: the actor holds bf16 weights cast from its fp32 masters after each step,
    and the engine borrows them all (a push moves nothing). Four steps with an evaluation at 2 and 4, against an
    engine with its own copy: every metric but the clocks the same."""
    common = ["trainer.total_steps=4", "trainer.test_freq=2", "trainer.save_freq=null", "actor.dtype=bfloat16",
              "rollout.dtype=bfloat16", "data.prompts_per_rollout=4", "data.responses_per_prompt=4"]
    rows, out = runs_by_share(tmp_path, common, ("null", "false"))
    assert len(rows["null"]) == 5 and rows["null"] == rows["false"]
    assert any("actor/sampler_kl" in r for r in rows["null"]) and any("test" in k for r in rows["null"] for k in r)
    assert "reads the actor's bf16 weights" in out["null"] and "reads the actor's bf16" not in out["false"]


@pytest.mark.parametrize("overrides,why", [
    (["actor.lora.rank=0"], "fully fine-tuned in fp32"),
    (["actor.dtype=bfloat16", "actor.master_weights=false"], "fully fine-tuned in fp32"),
    (["actor.dtype=bfloat16", "rollout.max_staleness=1"], "generates while the actor updates"),
    (["actor.dtype=bfloat16", "trainer.governor.enable=true"], "trainer.governor.enable=true"),
    (["actor.dtype=bfloat16", "rollout.model_name=stub/tool_model"], "rollout.model_name"),
    (["actor.lora.rank=4", "rollout.engine=sglang"], "rollout.engine=sglang"),
    (["actor.lora.rank=4", "actor.offload_model=true"], "offload_model"),
])
def test_a_required_shared_base_that_cannot_apply_names_why(in_repo_root, overrides, why):
    cfg = compose_config(["rollout.share_actor_base=true", *overrides])
    with pytest.raises(ConfigError, match=f"rollout.share_actor_base.*{why}"):
        validate(cfg, world_size=1)


def test_a_sharded_actor_cannot_lend_its_base(in_repo_root):
    cfg = compose_config(["rollout.share_actor_base=true", "actor.lora.rank=4", "data.prompts_per_rollout=4"])
    with pytest.raises(ConfigError, match="FSDP over 2.*actor.ddp_size=2"):
        validate(cfg, world_size=2)
    validate(compose_config(["rollout.share_actor_base=true", "actor.lora.rank=4", "actor.ddp_size=2",
                             "data.prompts_per_rollout=4"]), world_size=2)
