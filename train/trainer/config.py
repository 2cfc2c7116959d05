"""Config checks in one place: every bad or missing key fails before any model loads,
with the key's name and an example override."""
from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    pass


# Keys the user must choose, with an example override for the error message.
REQUIRED = {
    "data.train_data_path": "data.train_data_path=stub/data/math/train.jsonl",
    "data.prompts_per_rollout": "data.prompts_per_rollout=16",
    "actor.model_name": "actor.model_name=stub/model",
    "rollout.env_path": "rollout.env_path=environments/eq.py",
    "trainer.save_dir": "trainer.save_dir=runs/my_run",
}

AGG_MODES = ("all_token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
ESTIMATORS = ("reinforce", "rloo")
LOSSES = ("ppo", "gspo")
ENGINES = ("hf", "sglang")


def _get(cfg: DictConfig, key: str):
    return OmegaConf.select(cfg, key, default=None)


def _fail(key: str, problem: str, example: str | None = None) -> None:
    msg = f"config key '{key}': {problem}"
    if example:
        msg += f". Example override: {example}"
    raise ConfigError(msg)


def _positive_int(cfg: DictConfig, key: str, allow_none: bool = False) -> None:
    value = _get(cfg, key)
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(key, f"expected a positive integer, got {value!r}", f"{key}=1")


def _choice(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    value = _get(cfg, key)
    if value not in choices:
        _fail(key, f"expected one of {', '.join(choices)}; got {value!r}", f"{key}={choices[0]}")


def validate(cfg: DictConfig, world_size: int = 1) -> None:
    """Raise ConfigError for the first missing or inconsistent key."""
    for key, example in REQUIRED.items():
        if _get(cfg, key) is None:
            _fail(key, "is required (it is null in config/grpo.yaml)", example)

    _positive_int(cfg, "data.prompts_per_rollout")
    _positive_int(cfg, "data.responses_per_prompt")
    _positive_int(cfg, "actor.max_length_per_device")
    _positive_int(cfg, "actor.max_inference_length_per_device", allow_none=True)
    _positive_int(cfg, "actor.update_per_rollout")
    _positive_int(cfg, "actor.mini_batches")
    _positive_int(cfg, "rollout.max_turns")
    _positive_int(cfg, "rollout.max_batch_size")
    _positive_int(cfg, "rollout.env_workers")
    _positive_int(cfg, "trainer.n_epochs")
    for key in ("trainer.total_steps", "trainer.save_freq", "trainer.test_freq"):
        _positive_int(cfg, key, allow_none=True)
    for key in ("rollout.train_sampling_params.max_new_tokens", "rollout.test_sampling_params.max_new_tokens"):
        _positive_int(cfg, key)

    _choice(cfg, "actor.agg_mode", AGG_MODES)
    _choice(cfg, "actor.kl.type", KL_TYPES)
    if _get(cfg, "actor.kl.reward_estimator") is not None:
        _choice(cfg, "actor.kl.reward_estimator", KL_TYPES)
    _choice(cfg, "adv.estimator", ESTIMATORS)
    _choice(cfg, "actor.loss", LOSSES)
    _choice(cfg, "rollout.engine", ENGINES)
    _choice(cfg, "actor.scheduler", ("constant", "cosine"))
    _choice(cfg, "actor.dtype", ("float32", "bfloat16"))

    ppr = cfg.data.prompts_per_rollout
    if ppr % world_size != 0:
        _fail("data.prompts_per_rollout", f"{ppr} is not divisible by the {world_size} data-parallel ranks",
              f"data.prompts_per_rollout={max(world_size, ppr - ppr % world_size)}")
    if cfg.actor.lr <= 0:
        _fail("actor.lr", f"must be > 0, got {cfg.actor.lr}", "actor.lr=1e-6")
    if not 0.0 <= cfg.actor.warmup_ratio < 1.0:
        _fail("actor.warmup_ratio", f"must be in [0, 1), got {cfg.actor.warmup_ratio}", "actor.warmup_ratio=0.05")
    if cfg.actor.kl.coef < 0:
        _fail("actor.kl.coef", f"must be >= 0, got {cfg.actor.kl.coef}", "actor.kl.coef=0.001")
    if cfg.rollout.env_timeout_s <= 0:
        _fail("rollout.env_timeout_s", "must be > 0", "rollout.env_timeout_s=30")
    if cfg.trainer.test_freq is not None and _get(cfg, "data.test_data_path") is None:
        _fail("data.test_data_path", "is required when trainer.test_freq is set",
              "data.test_data_path=stub/data/math/test.jsonl (or trainer.test_freq=null)")

    for key in ("actor.model_name", "rollout.env_path"):
        path = _get(cfg, key)
        if not os.path.exists(path):
            _fail(key, f"path '{path}' does not exist (relative paths are from {os.getcwd()})",
                  REQUIRED[key])
    load = cfg.trainer.load_ckpt_from
    if load is not None and load != "latest" and not os.path.isdir(load):
        _fail("trainer.load_ckpt_from", f"'{load}' is not a checkpoint folder",
              "trainer.load_ckpt_from=latest")
