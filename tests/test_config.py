"""Config and data errors fail before any model loads, naming the key / file, row and field."""
import pytest
from hydra import compose, initialize_config_dir

from conftest import ROOT, run_trainer
from train.trainer.config import ConfigError, validate


def load(overrides=(), name="stub"):
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths are relative to the repo root


def test_stub_config_is_valid():
    validate(load(["trainer.save_dir=/tmp/x"]), world_size=2)


@pytest.mark.parametrize("key", ["data.train_data_path", "actor.model_name", "rollout.env_path",
                                 "data.prompts_per_rollout"])
def test_missing_required_key_names_it_with_an_example(key):
    cfg = load(["trainer.save_dir=/tmp/x", f"{key}=null"])
    with pytest.raises(ConfigError, match=rf"'{key}': is required.*Example override: {key}="):
        validate(cfg)


def test_base_config_lists_every_required_key():
    with pytest.raises(ConfigError, match="data.train_data_path"):
        validate(load(name="grpo"))


@pytest.mark.parametrize("override,pattern", [
    ("actor.agg_mode=token_mean", "actor.agg_mode.*one of all_token_mean"),
    ("data.prompts_per_rollout=3", "not divisible by the 2 data-parallel ranks"),
    ("actor.model_name=/no/such/model", "actor.model_name.*does not exist"),
    ("trainer.test_freq=5", None),
    ("rollout.max_turns=0", "rollout.max_turns.*positive integer"),
    ("actor.kl.type=k7", "actor.kl.type"),
])
def test_bad_values(override, pattern):
    cfg = load(["trainer.save_dir=/tmp/x", override])
    if pattern is None:
        validate(cfg, world_size=2)
    else:
        with pytest.raises(ConfigError, match=pattern):
            validate(cfg, world_size=2)


def test_test_freq_needs_test_data():
    cfg = load(["trainer.save_dir=/tmp/x", "data.test_data_path=null", "trainer.test_freq=5"])
    with pytest.raises(ConfigError, match="data.test_data_path.*trainer.test_freq=null"):
        validate(cfg)


def test_cli_missing_key_fails_fast(tmp_path):
    proc = run_trainer([f"trainer.save_dir={tmp_path}", "actor.model_name=null"], check=False)
    assert proc.returncode != 0
    assert "config key 'actor.model_name': is required" in proc.stderr
    assert "Example override: actor.model_name=stub/model" in proc.stderr


def test_cli_malformed_data_row_names_file_row_and_field(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "1 + 1"}], "answer": "2"}\n'
                    '{"messages": "1 + 2", "answer": "3"}\n')
    proc = run_trainer([f"trainer.save_dir={tmp_path / 'run'}", f"data.train_data_path={data}",
                        "trainer.test_freq=null"], check=False)
    assert proc.returncode != 0
    assert f"{data}: row 2: field 'messages'" in proc.stderr


def test_cli_env_without_reward_fn(tmp_path):
    env = tmp_path / "noreward.py"
    env.write_text("def interact(messages):\n    return []\n")
    proc = run_trainer([f"trainer.save_dir={tmp_path / 'run'}", f"rollout.env_path={env}"], check=False)
    assert proc.returncode != 0
    assert "defines no reward_fn" in proc.stderr


def test_values_with_equals_are_quoted_for_hydra():
    from train.trainer.grpo import quote_values_with_equals

    assert quote_values_with_equals(["data.train_data_path=verifiers:train?limit=32", "a=b", "--config-name",
                                     "stub", "x='y=z'"]) == [
        "data.train_data_path='verifiers:train?limit=32'", "a=b", "--config-name", "stub", "x='y=z'"]
    cfg = load(["trainer.save_dir=/tmp/x", *quote_values_with_equals(["data.train_data_path=verifiers:eval?limit=8"])])
    assert cfg.data.train_data_path == "verifiers:eval?limit=8"
