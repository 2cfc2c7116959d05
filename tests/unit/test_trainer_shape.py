"""The trainer's shape stays readable (issue 34): the step on one screen, the trainer holding only
its parts. Measured on the source, so a change that regrows either fails here, not in review."""
from __future__ import annotations

import ast

from conftest import ROOT


def _trainer() -> ast.ClassDef:
    tree = ast.parse((ROOT / "train/trainer/grpo.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")


def test_the_training_step_fits_on_one_screen():
    step = next(f for f in _trainer().body if isinstance(f, ast.FunctionDef) and f.name == "train_step")
    lines = step.end_lineno - step.lineno + 1
    assert lines <= 35, f"Trainer.train_step is {lines} lines; keep it to one screen (<= 35): move detail into its parts"


def test_the_trainer_holds_only_its_parts():
    attrs = {n.attr for n in ast.walk(_trainer()) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
             and isinstance(n.value, ast.Name) and n.value.id == "self"}
    assert len(attrs) <= 20, f"the Trainer assigns {len(attrs)} attributes (<= 20): {sorted(attrs)}"


def test_rollout_sources_share_one_interface():
    """The step calls the same methods whatever the source; the prefetching one overrides, never adds."""
    from train.trainer.inflight import ContinuousRollouts, InflightRollouts
    from train.trainer.rollouts import PrefetchedRollouts, RolloutSource

    step_calls = {"next", "hand_over", "before_push", "after_push", "settle", "pending", "restore", "inflight_state",
                  "resume_inflight", "close"}
    assert step_calls <= set(vars(RolloutSource))
    for source in (PrefetchedRollouts, InflightRollouts, ContinuousRollouts):
        public = {name for name in vars(source) if not name.startswith("_")}
        assert public <= set(vars(RolloutSource)), public - set(vars(RolloutSource))
