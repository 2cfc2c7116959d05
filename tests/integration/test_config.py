"""Config and data errors fail before any model loads, naming the key / file, row and field."""
import re

import pytest

from conftest import ROOT, compose_config, run_trainer
from train.trainer.config import ConfigError, validate

pytestmark = pytest.mark.usefixtures("in_repo_root")  # config paths are relative to the repo root


def test_stub_config_is_valid():
    validate(compose_config(), world_size=2)


def test_the_smollm2_recipe_is_valid():
    """docs/training.md's real-model recipe: data, env and settings validate (the model folder is made
    by scripts/prepare_smollm2.py, so the stub stands in for it here)."""
    cfg = compose_config(["actor.model_name=stub/model"], name="smollm2")
    validate(cfg, world_size=1)
    assert cfg.rollout.env_path == "environments/last_number.py" and cfg.data.train_data_path.endswith("arith/train.jsonl")


@pytest.mark.parametrize("key", ["data.train_data_path", "actor.model_name", "rollout.env_path",
                                 "data.prompts_per_rollout"])
def test_missing_required_key_names_it_with_an_example(key):
    cfg = compose_config([f"{key}=null"])
    with pytest.raises(ConfigError, match=rf"'{key}': is required.*Example override: {key}="):
        validate(cfg)


def test_base_config_lists_every_required_key():
    with pytest.raises(ConfigError, match="data.train_data_path"):
        validate(compose_config(name="grpo", save_dir=None))


@pytest.mark.parametrize("override,pattern", [
    ("actor.agg_mode=token_mean", "actor.agg_mode.*one of all_token_mean"),
    ("data.prompts_per_rollout=3", "not divisible by the 2 data-parallel ranks"),
    ("actor.model_name=/no/such/model", "actor.model_name.*does not exist"),
    ("trainer.test_freq=5", None),
    ("rollout.max_turns=0", "rollout.max_turns.*positive integer"),
    ("actor.kl.type=k7", "actor.kl.type"),
])
def test_bad_values(override, pattern):
    cfg = compose_config([override])
    if pattern is None:
        validate(cfg, world_size=2)
    else:
        with pytest.raises(ConfigError, match=pattern):
            validate(cfg, world_size=2)


@pytest.mark.parametrize("world,overrides,pattern", [
    (1, ["actor.master_weights=true"], "actor.master_weights.*true cannot apply: actor.dtype=float32"),
    (1, ["actor.master_weights=true", "actor.dtype=bfloat16"], None),
    (2, ["actor.master_weights=true", "actor.dtype=bfloat16"], "actor.master_weights.*over 2 ranks"),
    (2, ["actor.master_weights=true", "actor.dtype=bfloat16", "actor.ddp_size=2"], "over 2 ranks"),  # replicas
    (1, ["critic.master_weights=true", "critic.dtype=bfloat16", "adv.estimator=gae", "critic.offload_model=true"],
     "critic.master_weights.*critic.offload_model=true"),
])
def test_master_weights_true_where_they_cannot_apply_names_why_before_any_model_loads(world, overrides, pattern):
    cfg = compose_config(overrides)
    if pattern is None:
        validate(cfg, world_size=world)
    else:
        with pytest.raises(ConfigError, match=pattern):
            validate(cfg, world_size=world)


@pytest.mark.parametrize("device,overrides,want", [
    ("cpu", [], ("float32", "float32")),
    ("cuda", [], ("bfloat16", "bfloat16")),
    ("cuda", ["actor.dtype=float32"], ("float32", "bfloat16")),
    ("cpu", ["critic.dtype=bfloat16"], ("float32", "bfloat16")),
])
def test_a_null_dtype_is_bf16_on_a_gpu_and_fp32_on_a_cpu(device, overrides, want):
    """actor.dtype / critic.dtype null take the device's (validate sets them, as the trainer's run loads them);
    on a GPU master weights then apply to one process without being asked for the dtype."""
    cfg = compose_config(["actor.master_weights=true", *overrides] if device == "cuda" and not overrides else overrides)
    validate(cfg, world_size=1, device_type=device)
    assert (cfg.actor.dtype, cfg.critic.dtype) == want
    if device == "cpu" and not overrides:
        with pytest.raises(ConfigError, match="actor.dtype=float32"):
            validate(compose_config(["actor.master_weights=true"]), world_size=1, device_type="cpu")


def test_test_freq_needs_test_data():
    cfg = compose_config(["data.test_data_path=null", "trainer.test_freq=5"])
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
    cfg = compose_config([*quote_values_with_equals(["data.train_data_path=verifiers:eval?limit=8"])])
    assert cfg.data.train_data_path == "verifiers:eval?limit=8"


@pytest.mark.parametrize("override,pattern", [
    ("+rollout.train_sampling_params.foo=1", r"'rollout.train_sampling_params.foo': unknown sampling parameter.*"
                                             r"this engine takes: frequency_penalty"),
    ("+rollout.test_sampling_params.regex=x", r"'rollout.test_sampling_params.regex': unknown.*rollout.engine=hf"),
    ("+rollout.train_sampling_params.n=4", r"'rollout.train_sampling_params.n': .*data.responses_per_prompt"),
    ("rollout.train_sampling_params.top_p=2", r"'rollout.train_sampling_params.top_p': expected a value in \(0, 1\]"),
    ("rollout.train_sampling_params.min_p=-0.1", r"'rollout.train_sampling_params.min_p'"),
    ("rollout.train_sampling_params.stop_token_ids=[a]", r"'rollout.train_sampling_params.stop_token_ids'"),
    ("rollout.train_sampling_params.ignore_eos=1", r"'rollout.train_sampling_params.ignore_eos': expected true or false"),
    ("rollout.train_sampling_params.repetition_penalty=0", r"repetition_penalty': expected a value in \(0, inf\]"),
    ("adv.estimator=gae", None),
    ("adv.global_norm=true", None),
    ("adv.batch_whiten=true", None),
    ("adv.global_norm=true adv.batch_whiten=true", "adv.batch_whiten.*set only one"),
    ("adv.estimator=gae adv.global_norm=true", "adv.global_norm.*not gae"),
    ("adv.estimator=reinforce_pp adv.batch_whiten=true", "adv.batch_whiten"),
])
def test_sampling_and_advantage_keys(override, pattern):
    cfg = compose_config([*override.split()])
    if pattern is None:
        validate(cfg)
    else:
        with pytest.raises(ConfigError, match=pattern):
            validate(cfg)


def test_every_sampling_key_reaches_the_engine_and_sglang_takes_its_own():
    from train.trainer.config import sampling_params

    cfg = compose_config(["rollout.train_sampling_params.min_p=0.05",
                "rollout.train_sampling_params.stop_token_ids=[5,6]", "rollout.train_sampling_params.seed=3",
                "rollout.train_sampling_params.repetition_penalty=1.1", "rollout.train_sampling_params.ignore_eos=true"])
    sp = sampling_params(cfg.rollout, "train_sampling_params")
    assert (sp.min_p, sp.stop_token_ids, sp.seed, sp.repetition_penalty, sp.ignore_eos) == (0.05, (5, 6), 3, 1.1, True)
    cfg = compose_config(["rollout.engine=sglang", "+rollout.train_sampling_params.regex='[0-9]+'"])
    assert sampling_params(cfg.rollout, "train_sampling_params").extra == (("regex", "[0-9]+"),)


def test_save_dir_defaults_to_the_experiment_name():
    cfg = compose_config(["trainer.experiment_name=my-exp"], name="grpo", save_dir=None)
    assert cfg.trainer.save_dir == "ckpts/my-exp"
    explicit = compose_config(["trainer.experiment_name=my-exp"], name="grpo", save_dir="runs/x")
    assert explicit.trainer.save_dir == "runs/x"


def model_copy(tmp_path, name, **config_changes):
    import json
    import shutil

    from conftest import STUB_MODEL

    out = tmp_path / name
    shutil.copytree(STUB_MODEL, out)
    config = json.loads((out / "config.json").read_text())
    config.update(config_changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_rollout_model_name_defaults_and_must_match_the_actor(tmp_path):
    from train.trainer.config import resolve_aliases

    cfg = compose_config(["actor.model_name=null", "rollout.model_name=stub/model"])
    resolve_aliases(cfg)
    paths = validate(cfg)
    assert paths.actor == paths.rollout == paths.tokenizer == paths.rollout_tokenizer == "stub/model"
    same = model_copy(tmp_path, "same")  # another folder with the same architecture: accepted
    assert validate(compose_config([f"rollout.model_name={same}"])).rollout == str(same)
    other = model_copy(tmp_path, "other", vocab_size=640, num_hidden_layers=2)
    cfg = compose_config([f"rollout.model_name={other}"])
    with pytest.raises(ConfigError, match=r"'rollout.model_name': .*vocab_size: 640 vs the actor's 512.*"
                                          r"num_hidden_layers: 2 vs the actor's 4.*share architecture and vocabulary"):
        validate(cfg)


def test_rollout_tokenizer_must_share_the_vocabulary(tmp_path):
    import json

    tok = model_copy(tmp_path, "tok")
    data = json.loads((tok / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same tokens, other ids
    (tok / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="'rollout.tokenizer_name': .*different vocabularies"):
        validate(compose_config([f"rollout.tokenizer_name={tok}"]))
    assert validate(compose_config([f"rollout.tokenizer_name={ROOT / 'stub/model'}"]))


def test_cli_unknown_sampling_key_is_one_line(tmp_path):
    proc = run_trainer([f"trainer.save_dir={tmp_path}", "+rollout.train_sampling_params.top_a=0.5"], check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: config key 'rollout.train_sampling_params.top_a': unknown sampling parameter; this "
                      "engine takes: frequency_penalty, ignore_eos, max_new_tokens, min_p, presence_penalty, "
                      "repetition_penalty, seed, stop, stop_token_ids, temperature, top_k, top_p (rollout.engine=hf)"]


def test_the_pre_flight_check_says_ok_or_the_error_line(capsys):
    """`python -m train.trainer.config --check`: the trainer's composition and checks in one process."""
    from train.trainer.config import main

    assert main(["--check", "--nproc", "2", "--config-name", "stub", "trainer.save_dir=/tmp/x"]) == 0
    assert capsys.readouterr().out.strip() == (
        "ok (data read: the first 1000 rows of stub/data/math/train.jsonl, all 256 rows of stub/data/math/test.jsonl; "
        "later rows are checked when the run loads them, data.check_rows=null reads them all here)")
    assert main(["--check", "--nproc", "2", "--config-name", "stub", "trainer.save_dir=/tmp/x", "actor.lr=-1"]) == 2
    assert capsys.readouterr().err.strip() == ("error: config key 'actor.lr': expected a number > 0, got -1. "
                                               "Example override: actor.lr=1e-6")
    assert main(["--check", "--nproc", "3", "--config-name", "stub", "trainer.save_dir=/tmp/x"]) == 2
    assert "not divisible by the 3 data-parallel ranks" in capsys.readouterr().err
    assert main(["--check", "--config-name", "stub", "trainer.save_dir=/tmp/x", "actor.lrr=1"]) == 2  # a typo
    err = capsys.readouterr().err
    assert err.startswith("error: Could not override 'actor.lrr'. Key 'lrr' is not in struct") and err.count("\n") == 1


def test_a_rank_s_error_line_ends_the_launch(tmp_path):
    """Under train.launch (torchrun in-process) a rank's `error:` line comes last, with its exit code;
    plain torchrun's report names it in the rank's row (the error file every rank writes)."""
    import os
    import subprocess
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from conftest import trainer_env
    from train.utils.torchrun_errors import record_for_torchrun, recorded_line

    line = "error: config key 'actor.lr': expected a number > 0, got -1. Example override: actor.lr=1e-6"
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(tmp_path / "error.json")
    try:
        record_for_torchrun(line)
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(tmp_path / "error.json"))
    assert recorded_line(failure.message) == line
    assert f"traceback : {line}" in ChildFailedError("train.trainer.grpo", {0: failure}).format_msg()

    proc = subprocess.run([sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node=1",
                           "-m", "train.trainer.grpo", "--config-name", "stub", f"trainer.save_dir={tmp_path / 'run'}",
                           "actor.lr=-1"], cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in proc.stderr


def test_the_pre_flight_check_reads_the_data_and_refuses_what_the_run_would(tmp_path, capsys, in_repo_root):
    """`--check` runs the trainer's data checks on the rows it reads (the first data.check_rows of each
    source): an unknown source in a row, a contaminated test set under data.fail_on_contamination, a file
    that is not UTF-8 and a prompt that fills the context are the run's own error lines, not `ok`."""
    import json

    from train.trainer.config import main

    rows = [json.loads(line) for line in (ROOT / "stub/data/math/train.jsonl").read_text().splitlines()[:6]]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["--check", "--config-name", "stub", "trainer.save_dir=/tmp/x", f"data.train_data_path={train}",
            "data.prompts_per_rollout=2"]

    def error(*overrides: str) -> str:
        assert main([*base, *overrides]) == 2
        return capsys.readouterr().err.strip()

    routed = tmp_path / "routed.jsonl"
    routed.write_text("".join(json.dumps({**r, "source": "chem" if i == 1 else "math"}) + "\n"
                              for i, r in enumerate(rows)))
    assert error(f"data.train_data_path={routed}", "rollout.env_path={math: environments/eq.py}") == (
        f"error: data.train_data_path: {routed}: row 2: field 'source': 'chem' has no environment in "
        "rollout.env_path (sources with one: math); add 'rollout.env_path.chem'")

    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({**r, "messages": [{"role": "user", "content": "Compute this sum for me "
                                                          "please, it is the question number " + str(i) +
                                                          " of a set of many questions here"}]}) + "\n"
                            for i, r in enumerate(rows)))
    contaminated = [f"data.test_data_path={test}", f"data.train_data_path={test}"]
    assert error(*contaminated, "data.fail_on_contamination=true").startswith(
        "error: data.fail_on_contamination: 6 of 6 test prompts")
    assert main([*base, *contaminated]) == 0  # without the flag: the run's warning, then ok
    out = capsys.readouterr()
    assert "warning: 6 of 6 test prompts" in out.err and out.out.startswith("ok (data read: all 6 rows of ")

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(train.read_bytes() + '{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    assert error(f"data.train_data_path={latin}") == (
        f"error: {latin}: line 7 (byte {len(train.read_bytes()) + 15}) is not UTF-8 (invalid continuation byte); "
        "save the file as UTF-8")

    long = tmp_path / "long.jsonl"
    long.write_text(train.read_text() + json.dumps({"prompt": "x " * 2500, "answer": "1"}) + "\n")
    assert error(f"data.train_data_path={long}", "data.overlong_prompts=fail").startswith(
        f"error: {long}: row 7: the prompt is 5008 tokens with its chat template, as long as the 512-token context")
    assert main([*base, f"data.train_data_path={long}"]) == 0  # skip: the run's warning, then ok
    assert f"warning: {long}: row 7: the prompt is 5008 tokens" in capsys.readouterr().err

    # Bounded: rows past data.check_rows are not read, and the ok line says so.
    assert main([*base, f"data.train_data_path={long}", "data.overlong_prompts=fail", "data.check_rows=6"]) == 0
    assert capsys.readouterr().out.strip().startswith(f"ok (data read: the first 6 rows of {long}, the first 6 rows "
                                                      "of stub/data/math/test.jsonl; later rows are checked when")


def test_the_new_data_and_rollout_keys_are_checked():
    for override, key in [("data.overlong_prompts=drop", "data.overlong_prompts"),
                          ("data.check_rows=0", "data.check_rows"), ("rollout.max_env_chars=0", "rollout.max_env_chars")]:
        with pytest.raises(ConfigError, match=rf"config key '{re.escape(key)}'"):
            validate(compose_config([override]))
