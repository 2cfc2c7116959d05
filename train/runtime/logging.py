"""What a run leaves: metrics.jsonl, trajectories.jsonl, wandb (optional), a progress bar.
Only rank 0 writes; other ranks get a logger whose methods do nothing."""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from train.runtime.config import TrainerConfig

MAX_SOURCES_SHOWN = 4  # a mixture's per-source rewards on the progress bar, when it has at most this many


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def drop_rows_after(path: str, step: int) -> None:
    """Keep the JSONL rows of `path` whose "step" is at most `step` (rewritten atomically)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) > step:
                continue
        except (json.JSONDecodeError, AttributeError):  # a line cut by a crash mid-write
            continue
        kept.append(line)
    if len(kept) != len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


class RunLogger:
    def __init__(self, settings: TrainerConfig, config: Mapping, is_main: bool, total_steps: int,
                 start_step: int = 0):
        """`settings`: the trainer section; `config`: the whole run's config, written to config.yaml
        (and to wandb) as the run was given it."""
        self.is_main = is_main
        self.save_dir = settings.save_dir
        self.metrics_file = self.trajectories_file = None
        self.wandb = None
        self.bar = None
        if not is_main:
            return
        os.makedirs(self.save_dir, exist_ok=True)
        with open(os.path.join(self.save_dir, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(config, resolve=True))
        metrics, trajectories = (os.path.join(self.save_dir, n) for n in ("metrics.jsonl", "trajectories.jsonl"))
        if start_step > 0:  # a resume: what a crashed run logged after its checkpoint is re-done, not repeated
            drop_rows_after(metrics, start_step)
            drop_rows_after(trajectories, start_step)
        self.metrics_file = open(metrics, "a", buffering=1)
        self.trajectories_file = open(trajectories, "a", buffering=1)
        if settings.use_wandb:
            import wandb  # imported only when asked for

            self.wandb = wandb.init(project=settings.project, name=settings.experiment_name,
                                    config=OmegaConf.to_container(OmegaConf.create(config), resolve=True),
                                    dir=self.save_dir)
        if settings.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.metrics_file.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def event(self, kind: str, step: int, payload: dict) -> None:
        if not self.is_main:
            return
        row = {"type": kind, "step": step, "time": time.time(), **payload}
        self.trajectories_file.write(json.dumps(row, default=str) + "\n")

    def progress(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is None:
            return
        shown = {"reward": metrics.get("rewards/train")}
        if "rewards/test" in metrics:
            shown["test"] = metrics["rewards/test"]
        # A mixture's sources (at most a few: the bar is one line), test rewards where measured.
        kind = "test" if any(k.startswith("rewards/test/") for k in metrics) else "train"
        by_source = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"rewards/{kind}/")}
        if len(by_source) <= MAX_SOURCES_SHOWN:
            shown.update(sorted(by_source.items()))
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items() if v is not None}, refresh=False)
        self.bar.update(1)

    def write(self, line: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        for handle in (self.metrics_file, self.trajectories_file):
            if handle is not None:
                handle.close()
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def test_line(scores: dict[str, float]) -> str:
    """`test reward 0.512` and, for a mixture, each source's: `(code 0.200, math 0.700)`."""
    line = f"test reward {scores['rewards/test']:.3f}"
    parts = [f"{k.rsplit('/', 1)[1]} {v:.3f}" for k, v in sorted(scores.items()) if k.startswith("rewards/test/")]
    return line + (f" ({', '.join(parts)})" if parts else "")
