"""The `adv:` and `distill:` sections (config/grpo.yaml) as typed settings: the advantage estimator
and its normalisation (the estimator's choices are the registry's, train/algorithms/advantages.py),
and on-policy distillation's teacher and weights."""
from __future__ import annotations

import dataclasses

from train.algorithms.advantages import ESTIMATORS
from train.utils.typed_config import setting


@dataclasses.dataclass(frozen=True)
class AdvConfig:
    """`adv.*` (its alias `adv.lambda` is resolved into `adv.lamda` before this is built)."""
    estimator: str = setting("reinforce (group baseline, GRPO) | rloo | reinforce_pp | reinforce_pp_baseline | "
                             "gae (PPO)", choices=ESTIMATORS.names)
    norm_var: bool = setting("divide by the std (Bessel-corrected); false: Dr. GRPO")
    global_norm: bool = setting("reinforce/rloo: one baseline (and std) shared by the whole batch, all ranks, "
                                "instead of per group")
    batch_whiten: bool = setting("reinforce/rloo: per-group advantages, then whitened by the batch mean/std")
    whiten: bool = setting("gae: whiten advantages over all ranks' action tokens")
    gamma: float = setting("discount over action tokens (reinforce_pp, gae)", gt=0, le=1, example="1.0")
    lamda: float = setting("GAE lambda (adv.lambda=... works too)", ge=0, le=1, example="0.95")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """`distill.*`: on-policy distillation; the teacher scores the student's samples in the reference's slot."""
    teacher: str | None = setting("the teacher: a folder or a Hub id sharing the actor's tokenizer (null: no "
                                  "distillation)")
    teachers: dict[str, str] | None = setting("a teacher per data source (the names of data.train_data_path's "
                                              "mixture): {source: folder or Hub id}; a source not named uses "
                                              "distill.teacher, or without one learns from its reward alone")
    coef: float = setting("weight of the per-token reverse-KL advantage -(log pi_student - log pi_teacher)", ge=0,
                          example="1.0")
    reward_coef: float = setting("weight of the task advantage beside it (0: the teacher alone)", ge=0,
                                 example="0.0")

    @property
    def enabled(self) -> bool:
        """A teacher scores the samples (one for all, or some per source)."""
        return self.teacher is not None or bool(self.teachers)
