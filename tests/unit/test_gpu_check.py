"""The GPU check's one call (scripts/gpu_check.sh -> benchmarks/gpu_suite.py): what a lent GPU's few minutes
depend on and a CPU can check. Its children do not inherit the suite's own one-rank group, they find the wheels
on the path, and a time limit leaves what was measured."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from conftest import ROOT, trainer_env
from train.parallel.distributed import LAUNCHER_ENV, without_launcher_env

sys.path.insert(0, str(ROOT / "benchmarks"))


def test_a_child_gets_no_rank_or_rendezvous_of_its_parent(monkeypatch):
    """After build_actor's one-rank group (RANK, MASTER_PORT... set in the suite's process), a trainer started
    without torchrun must make its own group, not join the parent's port (EADDRINUSE)."""
    for key in LAUNCHER_ENV:
        monkeypatch.setenv(key, "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("HF_HOME", "/somewhere")
    env = without_launcher_env(os.environ)
    assert not [k for k in env if k in LAUNCHER_ENV or k.startswith("TORCHELASTIC_")]
    assert env["HF_HOME"] == "/somewhere"  # the rest is kept
    assert not [k for k in trainer_env() if k in LAUNCHER_ENV]


def test_tests_put_the_repository_first_and_keep_the_callers_path(monkeypatch):
    """scripts/gpu_check.sh puts the carried wheels (hydra, omegaconf...) on PYTHONPATH: a trainer a gpu test
    starts must still find them."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/gpu_check_site")
    assert trainer_env()["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/tmp/gpu_check_site"]
    monkeypatch.delenv("PYTHONPATH")
    assert trainer_env()["PYTHONPATH"] == str(ROOT)


def test_a_time_limit_records_the_running_section_and_starts_no_other(tmp_path, monkeypatch):
    """`timeout` sends SIGTERM at the limit: the section running is recorded as stopped, the sections after it
    do not start, and gpu_suite.json and .md hold what was measured before."""
    import gpu_suite

    ran = []

    def push(args, work, info, actor):
        ran.append("push")
        return {"params": 1, "seconds": 1.0, "s_per_billion": 1.0, "seconds_unverified": 1.0,
                "s_per_billion_unverified": 1.0}

    def stopped(args, work):
        ran.append("tests")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # interrupted by the handler
        raise AssertionError("SIGTERM did not stop the section")

    monkeypatch.setattr(gpu_suite, "section_push", push)
    monkeypatch.setattr(gpu_suite, "section_tests", stopped)
    monkeypatch.setattr(gpu_suite, "build_actor", lambda *a, **k: (None, None))
    monkeypatch.setattr(gpu_suite, "write_model", lambda shapes, folder: folder)
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = gpu_suite.main(["--tiny", "--only", "push,tests,demo", "--out", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 1 and ran == ["push", "tests"]  # demo never started
    sections = json.loads((tmp_path / "gpu_suite.json").read_text())["sections"]
    assert list(sections) == ["push", "tests"] and "error" not in sections["push"]
    assert sections["tests"]["error"].startswith("stopped by SIGTERM") and sections["tests"]["section_s"] < 30
    assert "stopped by SIGTERM" in (tmp_path / "gpu_suite.md").read_text()
