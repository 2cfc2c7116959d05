"""The algorithm keys: presets compose and validate, bad values fail with the key and an example."""
import pytest

from conftest import ROOT, compose_config
from train.trainer.config import ConfigError, resolve_aliases, validate

PRESETS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo"]

pytestmark = pytest.mark.usefixtures("in_repo_root")  # config paths are relative to the repo root


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_compose_and_validate(preset):
    cfg = compose_config([f"algorithm={preset}"])
    validate(cfg, world_size=2)
    assert cfg.actor.lr == 1e-4  # the stub's settings survive the preset


def test_presets_select_the_published_settings():
    assert compose_config(["algorithm=dapo"]).actor.clip_high == 0.28
    assert compose_config(["algorithm=dapo"]).rollout.dynamic_sampling
    assert compose_config(["algorithm=ppo"]).adv.estimator == "gae"
    assert compose_config(["algorithm=gspo"]).actor.loss == "gspo"
    assert compose_config(["algorithm=cispo"]).actor.loss == "cispo"
    assert compose_config(["algorithm=dr_grpo"]).adv.norm_var is False
    assert compose_config(["algorithm=rloo"]).adv.estimator == "rloo"
    assert compose_config(["algorithm=reinforce_pp"]).actor.kl.reward_estimator == "k1"
    # the default stays the seed's GRPO
    base = compose_config()
    assert (base.adv.estimator, base.actor.loss, base.actor.agg_mode, base.actor.kl.coef) == \
        ("reinforce", "ppo", "all_token_mean", 0.0)
    # command-line keys win over a preset
    assert compose_config(["algorithm=dapo", "actor.clip_high=0.3"]).actor.clip_high == 0.3


def test_lambda_alias():
    cfg = compose_config(["adv.estimator=gae", "adv.lambda=0.9"])
    resolve_aliases(cfg)
    assert cfg.adv.lamda == 0.9
    cfg = compose_config(["adv.estimator=gae", "adv.lambda=0.9", "adv.lamda=0.8"])
    with pytest.raises(ConfigError, match="adv.lambda.*conflicts"):
        resolve_aliases(cfg)


@pytest.mark.parametrize("overrides,pattern", [
    (["adv.estimator=ppo"], r"'adv.estimator'.*one of reinforce, rloo.*Example override: adv.estimator="),
    (["adv.estimator=gae", "adv.lamda=1.5"], r"'adv.lamda'.*\[0, 1\].*Example override: adv.lamda=0.95"),
    (["adv.gamma=0.9"], r"'adv.gamma'.*adv.estimator=gae"),
    (["adv.estimator=gae", "critic.clip=-1"], r"'critic.clip'.*Example override: critic.clip=0.5"),
    (["adv.estimator=gae", "critic.update_per_rollout=0"], r"'critic.update_per_rollout'.*positive integer"),
    (["actor.target_kl=0"], r"'actor.target_kl'.*Example override: actor.target_kl=0.02"),
    (["actor.tis_level=step"], r"'actor.tis_level'.*token, sequence"),
    (["actor.tis_cap=0"], r"'actor.tis_cap'"),
    (["actor.clip_low=1.2"], r"'actor.clip_low'.*< 1"),
    (["actor.mis_level=row"], r"'actor.mis_level'.*one of token, sequence"),
    (["actor.mis_level=token", "actor.mis_low=1.5"], r"'actor.mis_low'.*\(0, 1\).*Example override: actor.mis_low=0.5"),
    (["actor.mis_high=0.9"], r"'actor.mis_high'.*> 1.*Example override: actor.mis_high=2.0"),
    (["actor.loss=cispo", "actor.cispo_clip_high=0"], r"'actor.cispo_clip_high'.*> 0"),
    (["actor.loss=dro"], r"'actor.dro_beta'.*required.*Example override: actor.dro_beta=0.1"),
    (["actor.loss=clip_cov", "actor.cov_low=6"], r"'actor.cov_low'.*below actor.cov_high"),
    (["actor.cov_ratio=1.5"], r"'actor.cov_ratio'"),
    (["actor.sapo_tau_neg=0"], r"'actor.sapo_tau_neg'.*> 0"),
    (["actor.dppo_ratio_cap=0.5"], r"'actor.dppo_ratio_cap'.*> 1"),
    (["actor.entropy.schedule=exp"], r"'actor.entropy.schedule'"),
    (["actor.entropy.schedule=linear", "actor.entropy.coef=0.001", "actor.entropy.min_coef=0.01"],
     r"'actor.entropy.min_coef'.*floor"),
    (["rollout.dynamic_sampling=true", "data.responses_per_prompt=1"], r"'rollout.dynamic_sampling'.*>= 2"),
    (["rollout.overlong_buffer=100"], r"'rollout.overlong_buffer'.*\[1, 12\]"),
    (["rollout.overlong_buffer=1.5"], r"'rollout.overlong_buffer'"),
    (["actor.kl.reward_estimator=k1"], r"'actor.kl.coef'.*Example override: actor.kl.coef=0.01"),
    (["actor.kl.reward_estimator=k9", "actor.kl.coef=0.1"], r"'actor.kl.reward_estimator'"),
    (["trainer.governor.enable=true", "trainer.governor.min_history=99"], r"'trainer.governor.min_history'"),
    (["trainer.governor.enable=true", "trainer.governor.k_sigma=0"], r"'trainer.governor.k_sigma'"),
])
def test_bad_algorithm_values(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(compose_config(overrides), world_size=2)


REGISTRY_KEYS = ["adv.estimator", "actor.loss", "actor.kl.type", "actor.kl.reward_estimator", "actor.agg_mode"]


def registry_of(key):
    from train.algorithms.advantages import ESTIMATORS
    from train.algorithms.aggregation import AGG_MODES
    from train.algorithms.kl import KL_ESTIMATORS
    from train.algorithms.policy_loss import POLICY_LOSSES
    return {"adv.estimator": ESTIMATORS, "actor.loss": POLICY_LOSSES, "actor.kl.type": KL_ESTIMATORS,
            "actor.kl.reward_estimator": KL_ESTIMATORS, "actor.agg_mode": AGG_MODES}[key]


@pytest.mark.parametrize("key", REGISTRY_KEYS)
def test_the_choice_lists_are_the_registries_names(key):
    with pytest.raises(ConfigError) as e:
        validate(compose_config([f"{key}=nope"]), world_size=2)
    message = str(e.value)
    listed = message.split("expected one of ", 1)[1].split(";", 1)[0].split(", ")
    assert tuple(listed) == registry_of(key).names()
    assert f"'{key}'" in message and f"{key}={registry_of(key).names()[0]}" in message


def test_a_registered_estimator_is_a_valid_choice_with_nothing_else_edited(scoped_registries):
    from train.algorithms.advantages import AdvantageResult, estimator

    @estimator("zero_advantage", per_sequence=True)
    def zero_advantage(x, s):
        return AdvantageResult(0.0 * x.mask)

    validate(compose_config(["adv.estimator=zero_advantage"]), world_size=2)


# two sources (the same rows under two names), each with its environment
MIXTURE = "data.train_data_path={math: stub/data/math/train.jsonl, again: stub/data/math/train.jsonl}"
ENVS = "rollout.env_path={math: environments/eq.py, again: environments/eq.py}"


def test_teachers_by_source_are_resolved_beside_the_fallback():
    paths = validate(compose_config([MIXTURE, ENVS, "distill.teachers={math: stub/model}", "distill.teacher=stub/model"]),
                     world_size=2)
    assert list(paths.teachers) == ["math"] and paths.teachers["math"].endswith("stub/model")
    assert paths.reference.endswith("stub/model")


def test_the_distillation_teacher_takes_the_reference_slot():
    """algorithm=distill with a teacher validates, and the teacher is the model the reference slot loads."""
    paths = validate(compose_config(["algorithm=distill", "distill.teacher=stub/model"]), world_size=2)
    assert paths.reference.endswith("stub/model")
    cfg = compose_config(["algorithm=distill", "distill.teacher=stub/model"])
    assert (cfg.distill.reward_coef, cfg.distill.coef, cfg.rollout.dynamic_filtering) == (0.0, 1.0, False)


@pytest.mark.parametrize("overrides,pattern", [
    (["algorithm=distill"], r"'distill.teacher': is required with distill.reward_coef=0.*"
                            r"Example override: distill.teacher="),
    (["distill.teacher=stub/model", "actor.kl.coef=0.01"], r"'actor.kl.coef'.*teacher takes the reference's slot"),
    (["distill.teacher=stub/model", "distill.reward_coef=0", "rollout.dynamic_filtering=true"],
     r"'rollout.dynamic_filtering'.*Example override: rollout.dynamic_filtering=false"),
    (["distill.teacher=stub/model", "distill.coef=0", "distill.reward_coef=0", "rollout.dynamic_filtering=false"],
     r"'distill.coef'.*both 0"),
    (["distill.coef=-1"], r"'distill.coef'.*>= 0"),
    (["distill.teacher=no/such_teacher_model"], r"distill.teacher"),
    (["distill.teachers={math: stub/model}"], r"'distill.teachers': routes by data source, but "
                                               r"data.train_data_path is one unnamed source.*distill.teacher="),
    ([MIXTURE, "distill.teachers={chat: stub/model}"], r"'distill.teachers.chat': names no source of "
                                                        r"data.train_data_path \(its sources: math, again\)"),
    ([MIXTURE, "algorithm=distill", "distill.teachers={math: stub/model}"],
     r"'distill.teachers.again': is missing: with distill.reward_coef=0"),
    ([MIXTURE, "distill.teachers={math: no/such_teacher_model}"], r"distill.teachers.math"),
])
def test_bad_distillation_settings_name_their_key(overrides, pattern, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a teacher that is not a local folder is not found, not fetched
    with pytest.raises(ConfigError, match=pattern):
        validate(compose_config(overrides), world_size=2)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    """The teacher scores the student's token ids: a teacher whose vocabulary differs by one token is refused."""
    import shutil

    from transformers import AutoTokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(ROOT / "stub" / "model", teacher)
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.add_tokens(["<not_in_the_student>"])
    tok.save_pretrained(teacher)
    with pytest.raises(ConfigError, match=r"'distill.teacher': '.*teacher' has a different tokenizer from the "
                                          r"actor's .*<not_in_the_student>.*share one tokenizer"):
        validate(compose_config([f"distill.teacher={teacher}"]), world_size=2)
    with pytest.raises(ConfigError, match=r"'distill.teachers.again': '.*teacher' has a different tokenizer"):
        validate(compose_config([MIXTURE, ENVS, f"distill.teachers={{again: {teacher}}}"]), world_size=2)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "gmpo", "gpg", "dppo_tv", "dppo_kl", "sapo", "dro", "clip_cov",
                                  "kl_cov"])
def test_every_loss_finds_its_settings_in_the_config(loss):
    """The actor hands each loss the settings it reads, from the config's keys and defaults (config/grpo.yaml):
    no loss meets an unset one, and a key set on the command line is the value the loss sees."""
    import torch

    from conftest import run_config
    from train.algorithms.policy_loss import POLICY_LOSSES
    from train.models.actor import loss_settings

    extra = {"actor.dro_beta": 0.3} if loss == "dro" else {}
    settings = loss_settings(run_config({"actor.loss": loss, "actor.sapo_tau_neg": 2.5, "actor.cov_ratio": 0.01,
                                         "actor.kl_cov_coef": 0.7, "actor.dppo_ratio_cap": 7.0, **extra}).actor)
    assert (settings.tau_neg, settings.cov_ratio, settings.kl_cov_coef, settings.ratio_cap) == (2.5, 0.01, 0.7, 7.0)
    logp = -torch.rand(3, 5, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(3, 5, dtype=torch.float64)
    token_loss, _ = POLICY_LOSSES.get(loss)(logp, old, torch.randn(3, 5, dtype=torch.float64),
                                           torch.ones(3, 5, dtype=torch.bool), settings)
    assert torch.isfinite(token_loss).all()
