"""The typed config (train/trainer/schema.py, train/utils/typed_config.py): config/grpo.yaml and the
section classes list the same keys, every preset loads, what does not fit is refused with the key,
and only the entry points receive the whole config."""
from __future__ import annotations

import ast
import dataclasses
import re

import pytest
from omegaconf import OmegaConf

from conftest import ROOT, compose_config, run_config
from train.trainer.config import ConfigError, resolve_aliases, validate
from train.trainer.schema import RunConfig, load
from train.utils.typed_config import SectionError, build, describe, setting


def yaml_keys(node, prefix: str = "") -> list[str]:
    """Every leaf key of a config node; the values of open mappings (sampling params, sglang_kwargs,
    env_path) are one key each."""
    out = []
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        open_mapping = path.endswith(("sampling_params", "sglang_kwargs", "env_path"))
        if OmegaConf.is_dict(value) and not open_mapping:
            out += yaml_keys(value, path)
        else:
            out.append(path)
    return out


def test_the_yaml_and_the_section_classes_list_the_same_keys_each_with_a_doc():
    raw = OmegaConf.load(ROOT / "config" / "grpo.yaml")
    keys = {k for k in yaml_keys(raw) if not k.startswith(("defaults", "hydra")) and k != "adv.lambda"}
    described = describe(RunConfig)
    assert {key for key, _, _ in described} == keys
    assert all(doc.strip() and "\n" not in doc for _, _, doc in described)


@pytest.mark.parametrize("name", ["grpo", "stub", "smollm2", "code", "search", "judge", "verifiers"])
def test_every_config_and_algorithm_preset_loads(name):
    presets = [p.stem for p in (ROOT / "config" / "algorithm").glob("*.yaml")]
    for preset in [None, *presets]:
        cfg = compose_config([] if preset is None else [f"algorithm={preset}"], name=name, save_dir=None)
        resolve_aliases(cfg)
        run = load(cfg)
        assert isinstance(run, RunConfig) and run.adv.estimator == cfg.adv.estimator


@pytest.mark.parametrize("override,message", [
    # an unknown key (Hydra takes it with a '+'), named with the nearest one
    ("+actor.lrr=1", "config key 'actor.lrr': is not a setting: did you mean 'actor.lr'?"),
    ("+trainer.governor.windw=3", "config key 'trainer.governor.windw': is not a setting: did you mean "
                                  "'trainer.governor.window'?"),
    ("+rollout.no_such_thing=1", "config key 'rollout.no_such_thing': is not a setting: the section 'rollout' has "),
    # types
    ("actor.lr=abc", "config key 'actor.lr': expected a number > 0, got 'abc'. Example override: actor.lr=1e-6"),
    ("actor.mini_batches=1.5", "config key 'actor.mini_batches': expected a positive integer, got 1.5"),
    ("trainer.async_save=1", "config key 'trainer.async_save': expected true or false, got 1. Example override: "
                             "trainer.async_save=true"),
    ("actor.betas=[0.9,x]", "config key 'actor.betas': expected a list of numbers, got"),
    ("rollout.max_total_length=big", "config key 'rollout.max_total_length': expected a positive integer or null"),
    # bounds and choices
    ("actor.warmup_ratio=1.0", "config key 'actor.warmup_ratio': expected a number in [0, 1), got 1.0"),
    ("adv.estimator=ppo2", "config key 'adv.estimator': expected one of "),
    # a section's own relations (SectionError), with the full key
    ("data.curriculum.low=0.9", "config key 'data.curriculum.low': 0.9 is not below high=0.8"),
    ("trainer.governor.min_history=60", "config key 'trainer.governor.min_history': 60 is above the window 50"),
    ("actor.lora.rank=8", "config key 'actor.lora.target_modules': expected a non-empty list of module names"),
])
def test_what_does_not_fit_is_refused_with_the_key(override, message):
    extra = {"data.curriculum.low=0.9": ["data.curriculum.high=0.8"],
             "actor.lora.rank=8": ["actor.lora.target_modules=[]"]}.get(override, [])
    with pytest.raises(ConfigError) as err:
        validate(compose_config([override, *extra]))
    assert message in str(err.value)


@dataclasses.dataclass(frozen=True)
class Inner:
    a: int = setting("a", ge=0)
    b: int = setting("b", ge=0)

    def check(self) -> None:
        if self.a > self.b:
            raise SectionError("a", f"{self.a} is above b={self.b}", str(self.b))


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner = setting("the inner section")


def test_a_section_check_error_carries_its_path():
    assert build(Outer, {"inner": {"a": 1, "b": 2}}).inner == Inner(1, 2)
    with pytest.raises(ConfigError, match=re.escape("config key 'x.inner.a': 3 is above b=2. Example override: "
                                                    "x.inner.a=2")):
        build(Outer, {"inner": {"a": 3, "b": 2}}, "x")
    with pytest.raises(ConfigError, match=re.escape("config key 'x.inner.b': is missing")):
        build(Outer, {"inner": {"a": 3}}, "x")


@pytest.mark.parametrize("override", ["trainer.collective_timeout_s=0", "trainer.collective_timeout_s=soon"])
def test_a_key_read_before_the_config_loads_is_refused_as_the_whole_load_refuses_it(override):
    """`collective_timeout_s` is read before the process group exists, one field at a time; its message
    is the one the section's setting gives in the full load (one check, not a twin)."""
    from train.trainer.config import collective_timeout_s

    with pytest.raises(ConfigError) as alone:
        collective_timeout_s(compose_config([override]))
    with pytest.raises(ConfigError) as whole:
        validate(compose_config([override]))
    assert str(alone.value) == str(whole.value)
    assert "config key 'trainer.collective_timeout_s': expected a number > 0" in str(alone.value)
    assert collective_timeout_s(compose_config(["trainer.collective_timeout_s=30"])) == 30.0


def test_values_keep_their_python_types_and_containers_are_plain():
    run = run_config({"actor.clip": 1, "rollout.overlong_buffer": 4})
    assert type(run.actor.clip) is int and type(run.rollout.overlong_buffer) is int  # as given: numerics unchanged
    assert run.rollout.train_sampling_params["max_new_tokens"] == 128 and isinstance(run.actor.betas, list)
    assert isinstance(run.rollout.train_sampling_params, dict) and isinstance(run.actor.lora.target_modules, list)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.actor.lr = 1.0  # a part cannot change another part's settings


# Functions that take the whole config: the entry points (the trainer and the rollout ranks' start)
# and the config checks, which relate the sections to each other.
WHOLE_CONFIG_ALLOWED = {"train/trainer/config.py": None, "train/trainer/schema.py": None,
                        "train/trainer/grpo.py": {"__init__", "run", "main"}}


def test_only_the_entry_points_receive_the_whole_config():
    found = []
    for path in sorted((ROOT / "train").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        allowed = WHOLE_CONFIG_ALLOWED.get(rel, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in node.args.args + node.args.kwonlyargs:
                hint = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if hint in ("DictConfig", "RunConfig") and allowed is not None and node.name not in allowed:
                    found.append(f"{rel}:{node.lineno} {node.name}({arg.arg}: {hint})")
    assert found == [], "these receive the whole config; give them their section: " + "; ".join(found)
