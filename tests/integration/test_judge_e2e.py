"""A judge + NDCG GRPO run on CPU: the judge is train.serve on 127.0.0.1 (the search-tiny model
answering JSON), the search service is real. The judge's latency table reaches metrics.jsonl, and
killing the judge mid-run leaves the run alive with the failed judge calls counted."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, ranks_cmd, read_jsonl, running, search_service, trainer_env
from train.utils.services import stop

TABLE = ("count", "errors", "p50_s", "p95_s", "p99_s", "max_s", "wait_s")


def graded(metrics_file) -> bool:
    if not metrics_file.exists():
        return False
    return any(m.get("api/judge/count", 0) > m.get("api/judge/errors", 0) for m in read_jsonl(metrics_file))


@pytest.mark.slow
def test_judge_run_survives_the_judge_dying(tmp_path, search_tiny):
    port = free_port()
    serve = [sys.executable, "-m", "train.serve", "--model", search_tiny, "--served-model-name", "judge",
             "--port", str(port)]
    save = tmp_path / "run"
    steps = 6
    with search_service(tmp_path) as search_url, \
            running(serve, f"http://127.0.0.1:{port}/health", tmp_path / "judge.log") as judge:
        env = trainer_env()
        env.update(SEARCH_URL=search_url, JUDGE_BASE_URL=f"http://127.0.0.1:{port}/v1", JUDGE_MODEL="judge",
                   JUDGE_MAX_RETRIES="1", JUDGE_BACKOFF_S="0.05", JUDGE_TIMEOUT_S="20")
        cmd = ranks_cmd(1, "-m", "train.trainer.grpo", "--config-name", "judge", "trainer.progress_bar=false",
                        f"trainer.save_dir={save}", f"actor.model_name={search_tiny}", f"trainer.total_steps={steps}",
                        "trainer.test_freq=null", "data.prompts_per_rollout=4", "trainer.log_samples=16")
        with open(tmp_path / "trainer.log", "w") as log:
            run = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 600
                metrics_file = save / "metrics.jsonl"
                while not graded(metrics_file):  # wait for a step in which the live judge graded
                    assert run.poll() is None, (tmp_path / "trainer.log").read_text()[-4000:]
                    assert time.monotonic() < deadline, "no step with a judge call logged"
                    time.sleep(0.2)
                # The judge dies mid-run: SIGKILL, at once. (SIGTERM lets uvicorn finish in-flight
                # requests first, and a fast trainer can then end all its steps before the judge is gone.)
                judge.kill()
                judge.wait(30)
                killed_after = len(read_jsonl(metrics_file))
                assert run.wait(600) == 0, (tmp_path / "trainer.log").read_text()[-4000:]
            finally:
                stop(run)
    metrics = read_jsonl(save / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1)) and killed_after < steps - 1
    live = next(m for m in metrics if m.get("api/judge/count", 0) > m.get("api/judge/errors", 0))
    assert live["step"] <= killed_after  # the live judge graded before it was killed
    assert all(f"api/judge/{k}" in live for k in TABLE), sorted(live)  # the judge's latency table
    assert live["api/judge/p50_s"] > 0 and "api/search/count" in live
    after = metrics[killed_after + 1:]  # steps that started after the kill (the one in flight may mix)
    assert sum(m.get("api/judge/errors", 0) for m in after) > 0
    assert all(m.get("api/judge/errors", 0) == m.get("api/judge/count", 0) for m in after)
    assert sum(m["env/errors"] for m in after) > 0  # those samples scored rollout.env_error_reward
    events = read_jsonl(save / "trajectories.jsonl")
    errors = [e for e in events if e["type"] == "env_error" and e["step"] > killed_after + 1]
    assert errors and all("judge failed after 2 attempts: APIConnectionError" in e["error"] for e in errors)
    assert any(e["type"] == "api_stats" and "api/judge/errors" in e["stats"] for e in events)
