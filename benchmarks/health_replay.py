"""Replay finished runs' metrics through the training-health detector (train/trainer/health.py), to see which
alarms its rules would raise with the config's thresholds, or with others, without training again:

    .venv/bin/python benchmarks/health_replay.py runs/stub runs/smollm2 [--set patience=5 --set clip_fraction=0.2]

Prints each run's alarms (step, rule, message) and a count per rule; a run that raises none prints "clean".
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.trainer.health import HealthDetector  # noqa: E402


def thresholds(overrides: list[str]) -> dict:
    section = yaml.safe_load((ROOT / "config" / "grpo.yaml").read_text())["trainer"]["health"]
    section.pop("enable")
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in section:
            sys.exit(f"--set {item}: trainer.health has no key {key!r} (it has: {', '.join(section)})")
        section[key] = type(section[key])(value)
    return section


def replay(run: Path, settings: dict) -> list[tuple[int, str, str]]:
    detector = HealthDetector(**settings)
    alarms = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "actor/loss" not in row:  # an evaluation-only row (step 0) has no update to judge
            continue
        alarms += [(row["step"], a.rule, a.message) for a in detector.observe(row)]
    return alarms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (each holds metrics.jsonl)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a trainer.health threshold")
    args = ap.parse_args()
    settings = thresholds(args.set)
    for run in args.runs:
        alarms = replay(run, settings)
        steps = sum(1 for line in (run / "metrics.jsonl").read_text().splitlines() if '"actor/loss"' in line)
        if not alarms:
            print(f"{run}: clean ({steps} updates)")
            continue
        print(f"{run}: {len(alarms)} alarm(s) in {steps} updates: {dict(Counter(r for _, r, _ in alarms))}")
        for step, rule, message in alarms:
            print(f"  step {step}: {rule}: {message}")


if __name__ == "__main__":
    main()
