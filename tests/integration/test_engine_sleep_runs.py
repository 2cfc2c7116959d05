"""rollout.sleep in trainer runs (train/trainer/engine_sleep.py): the setting reaches the step, which says what it
decided and records it (`engine/slept`); on a GPU an engine kept awake keeps its CUDA graphs from step to step,
where a sleeping one captures them again after every update."""
import pytest
import torch

from conftest import read_jsonl, run_trainer


def gpu(test):
    """Marked `gpu` (benchmarks/gpu_suite.py runs it) and skipped without a CUDA GPU."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
    return pytest.mark.gpu(skip(test))


COMMON = ["trainer.test_freq=null", "trainer.save_freq=null"]


def test_an_engine_told_not_to_sleep_stays_awake_and_the_run_says_so(tmp_path):
    proc = run_trainer([f"trainer.save_dir={tmp_path}", "trainer.total_steps=2", "rollout.sleep=false", *COMMON])
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "engine/slept" in r]
    assert [r["engine/slept"] for r in rows] == [0.0, 0.0]
    assert all("time/engine_sleep_s" not in r and r["time/engine_wake_s"] >= 0 for r in rows)
    assert "the engine stays awake through the update" in proc.stdout + proc.stderr
    events = [e for e in read_jsonl(tmp_path / "trajectories.jsonl") if e["type"] == "engine_sleep"]
    assert len(events) == 1 and events[0]["step"] == 1 and "rollout.sleep=false" in events[0]["line"]


@gpu
def test_on_a_gpu_null_keeps_a_small_runs_engine_and_its_graphs_awake(tmp_path):
    """The stub on one GPU (the update's plan is a few MiB): null keeps the engine awake, and its CUDA graphs
    are captured once; told to sleep, it captures them again at every step."""
    runs = {}
    for sleep in ("null", "true"):
        proc = run_trainer([f"trainer.save_dir={tmp_path / sleep}", "trainer.total_steps=2", f"rollout.sleep={sleep}",
                            "rollout.compile_decode=false", *COMMON])
        runs[sleep] = ([r for r in read_jsonl(tmp_path / sleep / "metrics.jsonl") if "engine/slept" in r],
                       proc.stdout + proc.stderr)
    awake, asleep = runs["null"][0], runs["true"][0]
    assert [r["engine/slept"] for r in awake] == [0.0] * 2 and [r["engine/slept"] for r in asleep] == [1.0] * 2
    assert "the engine stays awake through the update" in runs["null"][1]
    graphs_awake, graphs_asleep = [r["engine/cuda_graphs"] for r in awake], [r["engine/cuda_graphs"] for r in asleep]
    assert graphs_asleep[0] > 0 and all(b > a for a, b in zip(graphs_asleep, graphs_asleep[1:])), graphs_asleep
    assert graphs_awake[-1] < graphs_asleep[-1], (graphs_awake, graphs_asleep)
    assert all(r["time/engine_sleep_s"] > 0 for r in asleep)
