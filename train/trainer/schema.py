"""The run's config as typed sections (config/grpo.yaml's keys, defaults and comments; the classes
are owned by the layers that use them): `load` checks every key's type, bounds and choices and
refuses unknown keys, naming the nearest one (train/utils/typed_config.py). The entry points load
it once; each component then receives its own section."""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from train.algorithms.config import AdvConfig, DistillConfig
from train.datasets.config import DataConfig
from train.models.config import ActorConfig, CriticConfig, RefActorConfig
from train.runtime.config import TrainerConfig
from train.utils.typed_config import build, setting
from train.workers.config import RolloutConfig


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every section of a run (config/grpo.yaml)."""
    data: DataConfig = setting("what to train and evaluate on, and how to draw it")
    actor: ActorConfig = setting("the policy that trains: model, optimizer, loss, LoRA, layout")
    ref_actor: RefActorConfig = setting("the KL reference (actor.kl.coef > 0) or the teacher's layout "
                                        "(distill.teacher): the actor's unless told")
    rollout: RolloutConfig = setting("generation and the environments: engine, sampling, turns, staleness")
    critic: CriticConfig = setting("the value model (adv.estimator=gae)")
    adv: AdvConfig = setting("the advantage estimator and its normalisation")
    distill: DistillConfig = setting("on-policy distillation from a teacher (distill.teacher)")
    trainer: TrainerConfig = setting("the run: steps, checkpoints, evaluation, logging, safety nets")


def load(cfg: DictConfig) -> RunConfig:
    """The composed Hydra config (aliases resolved: train/trainer/config.py's `resolve_aliases`) as a
    RunConfig; raises ConfigError naming the first key that does not fit."""
    node = cfg
    if "lambda" in cfg.get("adv", {}):  # the alias of adv.lamda (resolved into it by resolve_aliases)
        node = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        del node.adv["lambda"]
    return build(RunConfig, node)
