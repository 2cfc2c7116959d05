"""The `data:` section (config/grpo.yaml) as typed settings: what to train and evaluate on, how it is
drawn (`data.curriculum.*`) and checked before training."""
from __future__ import annotations

import dataclasses
from typing import Any

from train.utils.typed_config import SectionError, setting

POLICIES = ("uniform", "skip_saturated", "prioritized")  # data.curriculum.policy (train/datasets/curriculum.py)
OVERLONG_CHOICES = ("skip", "fail")  # data.overlong_prompts (train/trainer/data_check.py)


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
    """`data.curriculum.*`: per-prompt pass rates and the sampling policy that uses them."""
    policy: str = setting("uniform | skip_saturated (skip prompts always or never solved) | prioritized "
                          "(weight p(1-p) + floor)", choices=POLICIES)
    ema_decay: float = setting("pass-rate EMA: ema <- decay * ema + (1 - decay) * the group's pass rate",
                               ge=0, le=1, example="0.7")
    pass_threshold: float = setting("a response passes when its reward >= this", example="1.0")
    min_visits: int = setting("skip_saturated: visits before a prompt may be skipped", ge=1)
    low: float = setting("skip_saturated: EMA pass rate at or below this: never solved", ge=0, le=1, example="0.0")
    high: float = setting("skip_saturated: EMA pass rate at or above this: always solved", ge=0, le=1,
                          example="1.0")
    # Both keep every prompt reachable: a skipped prompt can come back, a solved one keeps a weight.
    recheck: float = setting("skip_saturated: chance per epoch that a skipped prompt is rolled out anyway",
                             gt=0, le=1, example="0.1")
    floor: float = setting("prioritized: every prompt keeps at least this weight", gt=0, example="0.02")

    def check(self) -> None:
        if self.ema_decay == 1.0:
            raise SectionError("ema_decay", "1.0 would never move the average", "0.7")
        if self.low >= self.high:
            raise SectionError("low", f"{self.low} is not below high={self.high}", "0.0")


REPLAY_PRIORITIES = ("success", "advantage", "uniform")  # data.replay.priority (train/trainer/replay.py)


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """`data.replay.*`: past groups mixed into later steps, drawn by priority (train/trainer/replay.py)."""
    enable: bool = setting("keep informative groups and replay some of them in later steps")
    share: float = setting("replayed groups per step, as a share of the step's prompts", gt=0, le=4,
                           example="0.25")
    capacity: int = setting("groups each rank keeps; the lowest priority leaves first", ge=1)
    priority: str = setting("success (rare successes: 1 - pass rate of a group with some) | advantage (mean "
                            "|reward - group mean|) | uniform", choices=REPLAY_PRIORITIES)
    criterion: str | None = setting("success: the rubric criterion whose score decides a pass (null: the reward; "
                                    "data.curriculum.pass_threshold either way)")
    alpha: float = setting("draws are proportional to priority ** alpha (0: uniform)", ge=0, example="1.0")
    max_age: int = setting("a group older than this many steps is dropped (staleness cap)", ge=1, example="8")
    max_uses: int = setting("times a group is replayed before it leaves", ge=1, example="2")
    favour_failing: float = setting("adaptive replay: while the forgetting gate sees a source's held-out metric "
                                    "fallen, that source's groups weigh this many times more (1: off)", ge=1,
                                    example="4.0")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """`data.*`: the train and test sources, the batch shape, the curriculum and the start-up data checks."""
    train_data_path: Any = setting("must choose: a file/dir (json, jsonl, csv, parquet, arrow), split@repo, "
                                   "verifiers:train?limit=N, or a mixture {name: path | {path, weight}}")
    test_data_path: Any = setting("optional (evaluation needs it, and trainer.test_freq): a path or a mixture")
    prompts_per_rollout: int | None = setting("must choose: prompts per step, all ranks together", ge=1)
    responses_per_prompt: int = setting("group size: responses sampled per prompt", ge=1)
    shuffle: bool = setting("shuffle the train rows every epoch")
    curriculum: CurriculumConfig = setting("what to roll out: per-prompt pass rates and the sampling policy")
    replay: ReplayConfig = setting("prioritized replay of past groups (off by default)")
    contamination_ngram: int = setting("test prompts sharing this many consecutive words with a train prompt are "
                                       "reported at start-up", ge=1)
    fail_on_contamination: bool = setting("true: train/test overlap stops the run")
    overlong_prompts: str = setting("a prompt as long as the context or longer: skip (its row is not trained) | "
                                    "fail (an error stops the run)", choices=OVERLONG_CHOICES)
    check_rows: int | None = setting("the first N rows of each source are tokenized and checked before training "
                                     "(null: every row)", ge=1)
    min_pixels: int | None = setting("vision-language models: each image is resized to at least this many pixels "
                                     "(null: the model's preprocessor_config.json)", ge=1, example="3136")
    max_pixels: int | None = setting("vision-language models: each image is resized to at most this many pixels, "
                                     "which bounds its image tokens (null: the model's preprocessor_config.json)",
                                     ge=1, example="200704")
    max_source_pixels: int = setting("an image with more pixels than this before resizing is refused (an error "
                                     "naming the row or env reply)", ge=1)
