"""The `trainer:` section (config/grpo.yaml) as typed settings: steps, checkpoints, evaluation,
logging and the safety nets (watchdog, sync probe, governor)."""
from __future__ import annotations

import dataclasses
import re

from train.utils.typed_config import SectionError, setting


@dataclasses.dataclass(frozen=True)
class GovernorConfig:
    """`trainer.governor.*`: roll back catastrophic updates (NaN/inf, k-sigma spikes)."""
    enable: bool = setting("roll back catastrophic updates")
    watch: list[str] = setting("the metrics judged for spikes")
    max_weight_change: float = setting("an update changing the actor's weight norm by more than this fraction is a "
                                       "panic (warned about when the governor is off)", gt=0, example="0.05")
    window: int = setting("accepted steps in the running window", ge=1)
    min_history: int = setting("spikes are judged once the window holds this many", ge=1)
    k_sigma: float = setting("a value this many standard deviations from the window mean is a spike", gt=0,
                             example="6")
    rel_std_floor: float = setting("the spread is at least this fraction of |window mean|", ge=0, example="0.25")
    min_panics: int = setting("consecutive panics before a rollback", ge=1)

    def check(self) -> None:
        if self.min_history > self.window:
            raise SectionError("min_history", f"{self.min_history} is above the window {self.window}",
                               str(self.window))
        if self.enable and not self.watch:
            raise SectionError("watch", "lists no metric", "[actor/loss,actor/grad_norm]")


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    """`trainer.health.*`: the training-health detector (train/trainer/health.py)."""
    enable: bool = setting("warn when a rule over the step's metrics holds `patience` steps in a row")
    escalate: str = setting("warn | governor: an alarm is also a governor panic (needs trainer.governor.enable)",
                            choices=("warn", "governor"))
    patience: int = setting("steps in a row a rule must hold before it alarms", ge=1)
    window: int = setting("steps the grad_norm and length rules look back", ge=1)
    warmup: int = setting("steps before the rules that compare with the past judge", ge=0)
    ratio_max: float = setting("actor/ratio_max above this alarms", gt=1, example="20")
    ratio_min: float = setting("actor/ratio_min below this alarms", ge=0, lt=1, example="0.01")
    clip_fraction: float = setting("actor/clip_fraction above this alarms", ge=0, le=1, example="0.3")
    entropy_floor: float = setting("actor/entropy below this alarms (collapse)", ge=0, example="0.001")
    explained_variance_floor: float = setting("critic/explained_variance below this alarms", example="-1")
    grad_norm_factor: float = setting("actor/grad_norm above this multiple of its median alarms", gt=1, example="10")
    length_growth: float = setting("response_length/train this many times its value `window` steps ago ...", gt=1,
                                   example="2")
    flat_reward: float = setting("... while rewards/train rose by less than this, alarms", example="0.02")


@dataclasses.dataclass(frozen=True)
class ForgettingConfig:
    """`trainer.forgetting.*`: held-out test sets guarded against forgetting (train/trainer/forgetting.py)."""
    watch: list[str] = setting("evaluation metrics guarded (rewards/test[/<source>], pass@<k>/test[/<source>] with "
                               "trainer.test_samples); []: off")
    max_drop: float = setting("a watched metric this far below its first evaluation is forgetting", ge=0,
                              example="0.05")
    action: str = setting("warn | rollback: also restore and push the last passing evaluation's weights | raise_kl: "
                          "also multiply actor.kl.coef by kl_factor", choices=("warn", "rollback", "raise_kl"))
    kl_factor: float = setting("raise_kl: the KL coefficient's multiplier at each alarm", gt=1, example="2.0")
    max_kl: float | None = setting("kl_to_start/test (the policy's KL to its starting policy on the sampled test "
                                   "replies) above this is forgetting too (null: not judged)", gt=0, example="0.5")

    def check(self) -> None:
        bad = [m for m in self.watch if not (m in ("rewards/test", "rewards/test_sampled") or m.startswith("rewards/test/")
                                             or re.fullmatch(r"pass@\d+/test(/.+)?", m))]
        if bad:
            raise SectionError("watch", f"{bad} are not evaluation metrics (rewards/test[/<source>], "
                               "rewards/test_sampled, pass@<k>/test[/<source>])", "[rewards/test]")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """`trainer.*`: the run."""
    project: str = setting("the wandb project")
    experiment_name: str = setting("the run's name")
    save_dir: str | None = setting("must choose: the run folder (metrics, trajectories, checkpoints, latest/)")
    n_epochs: int = setting("passes over the train data", ge=1)
    total_steps: int | None = setting("steps to train (null: n_epochs x batches per epoch)", ge=1)
    save_freq: int | None = setting("checkpoint every N steps (null: only the final export)", ge=1)
    overwrite: bool = setting("save_dir holds another run: true moves it aside and starts over")
    warn_skipped_steps: int | None = setting("warn when this many steps in a row made no update (null: never)", ge=1)
    watchdog_min_s: float | None = setting("a step phase running past max(this, watchdog_factor x its longest) "
                                           "dumps stacks and ends the rank (null: off)", gt=0, example="1800")
    watchdog_factor: float = setting("the watchdog's multiple of a phase's longest run", ge=1, example="10")
    save_on_signal: bool = setting("SIGTERM / SIGINT: a checkpoint at the next step boundary, then exit 0")
    collective_timeout_s: float = setting("a collective waiting longer fails the run", gt=0, example="600")
    verify_push: bool = setting("after each weight push the engine's checksums must equal what was sent")
    sync_probe_every: int | None = setting("every N steps the engine's and the trainer's log-probs of a fixed "
                                           "sequence must agree (null: never)", ge=1)
    sync_probe_tol: float | None = setting("the probe's largest mean |log-prob difference| (null: 1e-3 in float32, "
                                           "0.1 with bf16 anywhere)", gt=0, example="0.001")
    test_freq: int | None = setting("evaluate every N steps, and before/after (null: no evaluation)", ge=1)
    test_samples: int = setting("each evaluation also samples this many replies per test row for pass@k (0: greedy "
                                "only)", ge=0, example="8")
    test_pass_k: list[int] = setting("pass@k reported for each k (each at most test_samples)")
    test_temperature: float = setting("the temperature of those sampled replies", gt=0, example="1.0")
    load_ckpt_from: str | None = setting("resume from: latest | a step{N} folder")
    async_save: bool = setting("write checkpoint shards in the background while training goes on")
    keep_last_n: int | None = setting("keep only the newest N complete checkpoints (null: all)", ge=1)
    export_shard_gb: float = setting("latest/: safetensors shards of at most this size", gt=0, example="2")
    model_fetch_timeout_s: float | None = setting("how long ranks wait for their node's local rank 0 to download "
                                                  "Hub models", gt=0, example="7200")
    use_wandb: bool = setting("log metrics to Weights & Biases")
    seed: int = setting("the run's seed")
    num_threads: int | None = setting("torch threads per rank (null: cores / local ranks)", ge=1)
    log_samples: int = setting("sampled conversations per rank written to trajectories.jsonl each step", ge=0)
    progress_bar: bool = setting("show the progress bar")
    governor: GovernorConfig = setting("roll back catastrophic updates (NaN/inf, k-sigma spikes)")
    health: HealthConfig = setting("rules over each step's metrics that warn when a run degrades")
    forgetting: ForgettingConfig = setting("held-out test sets guarded against forgetting")

    def check(self) -> None:
        bad = [k for k in self.test_pass_k if not 1 <= k <= max(self.test_samples, 1)]
        if self.test_samples and bad:
            raise SectionError("test_pass_k", f"{bad} must be between 1 and trainer.test_samples={self.test_samples}",
                               f"[1, {self.test_samples}]")
