"""RunLogger: the files a run leaves, the progress bar, wandb in offline mode, rank-0 only."""
import dataclasses
import io
import json

from conftest import run_config
from train.runtime.logging import RunLogger


def cfg(save_dir, wandb=False, bar=True):
    """(the trainer section, the whole config) as the trainer hands them to its logger."""
    run = run_config({"trainer.save_dir": str(save_dir), "trainer.use_wandb": wandb, "trainer.project": "p",
                      "trainer.experiment_name": "e", "trainer.progress_bar": bar})
    return run.trainer, {"trainer": dataclasses.asdict(run.trainer)}


def test_metrics_events_and_nonfinite_values(tmp_path):
    log = RunLogger(*cfg(tmp_path, bar=False), is_main=True, total_steps=3)
    log.log_metrics(1, {"rewards/train": 0.5, "actor/grad_norm": float("nan"), "x": float("inf")})
    log.event("checkpoint", 1, {"path": "p"})
    log.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {"step": 1, "rewards/train": 0.5, "actor/grad_norm": None, "x": 1e308}
    event = json.loads((tmp_path / "trajectories.jsonl").read_text())
    assert event["type"] == "checkpoint" and event["step"] == 1 and "time" in event
    assert "save_dir" in (tmp_path / "config.yaml").read_text()


def test_other_ranks_write_nothing(tmp_path):
    log = RunLogger(*cfg(tmp_path / "r1"), is_main=False, total_steps=3)
    log.log_metrics(1, {"a": 1.0})
    log.event("x", 1, {})
    log.progress(1, {"rewards/train": 1.0})
    log.close()
    assert not (tmp_path / "r1").exists()


def test_progress_bar_shows_step_reward_and_eta(tmp_path, monkeypatch):
    import tqdm

    stream = io.StringIO()
    original = tqdm.tqdm.__init__

    def init(self, *a, **kw):
        kw["file"] = stream
        kw["mininterval"] = 0
        original(self, *a, **kw)

    monkeypatch.setattr(tqdm.tqdm, "__init__", init)
    log = RunLogger(*cfg(tmp_path), is_main=True, total_steps=4)
    log.progress(1, {"rewards/train": 0.25})
    log.progress(2, {"rewards/train": 0.5, "rewards/test": 0.75})
    log.close()
    out = stream.getvalue()
    assert "2/4" in out and "reward=0.500" in out and "test=0.750" in out and "<" in out  # elapsed<remaining


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLogger(*cfg(tmp_path, wandb=True, bar=False), is_main=True, total_steps=2)
    log.log_metrics(1, {"rewards/train": 0.5})
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())
