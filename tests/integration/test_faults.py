"""Nothing lost, nothing hung: what a hostile or careless run does to the trainer. Each test here
failed on the code before it (see the issue's closing note)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import ROOT, can_mount_in_a_namespace, ranks_cmd, read_jsonl, slow, trainer_env

SMALL = ["data.prompts_per_rollout=4", "data.responses_per_prompt=4", "rollout.dynamic_filtering=false",
         "trainer.test_freq=null", "trainer.progress_bar=false"]

HUGE_TOOL_ENV = """
def interact(messages):
    return [{"role": "tool", "content": "x" * 1_000_000}]  # 1 MB, far beyond the stub's 512-token context

def reward_fn(messages, answer):
    return 1.0 if answer in messages[-1]["content"] else 0.0
"""


def trainer_cmd(nproc: int, overrides: list[str]) -> list[str]:
    return ranks_cmd(nproc, "-m", "train.trainer.grpo", "--config-name", "stub", *overrides)


def peak_rss_of(cmd: list[str], timeout: int = 300) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd` under a small Python parent; (result, the largest descendant's peak RSS in MiB)."""
    wrapper = ("import json, resource, subprocess, sys; cmd = json.loads(sys.argv[1]); "
               "p = subprocess.run(cmd, capture_output=True, text=True); "
               "sys.stdout.write(p.stdout); sys.stderr.write(p.stderr); "
               "print('PEAK_RSS_MIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024); "
               "sys.exit(p.returncode)")
    proc = subprocess.run([sys.executable, "-c", wrapper, json.dumps(cmd)], cwd=ROOT, env=trainer_env(),
                          capture_output=True, text=True, timeout=timeout)
    peak = float(proc.stdout.rsplit("PEAK_RSS_MIB", 1)[1].split()[0])
    return proc, peak


@pytest.mark.slow
def test_a_huge_tool_message_ends_the_episode_within_the_context(tmp_path):
    """A 1 MB tool message never enters the conversation: the episode ends with finish reason
    `context` (event and metric), the run completes, memory stays bounded."""
    env = tmp_path / "huge_env.py"
    env.write_text(textwrap.dedent(HUGE_TOOL_ENV))
    run = tmp_path / "run"
    proc, peak = peak_rss_of(trainer_cmd(2, [f"trainer.save_dir={run}", f"rollout.env_path={env}",
                                             "rollout.max_turns=2", "trainer.total_steps=2",
                                             "trainer.log_samples=100", *SMALL]))
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"peak RSS of a rank with a 1 MB tool message: {peak:.0f} MiB")
    assert peak < 2048, peak  # before: ~11 GB per rank, then OOM-killed
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert any(m["context_overflow_ratio/train"] > 0 for m in metrics)
    samples = [e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "sample"]
    overflowed = [s for s in samples if s["finish_reason"] == "context"]
    assert overflowed and all(m["role"] != "tool" for s in overflowed for m in s["messages"])
    # cut to 16 characters per token of room before tokenization (rollout.max_env_chars), then still too long
    assert all([e["type"] for e in s["events"]] == ["env_truncated", "context_overflow"] for s in overflowed)
    assert all(s["events"][0]["chars"] == 1_000_000 and s["events"][1]["env_tokens"] > s["events"][1]["room"]
               for s in overflowed)
    assert all(m["env/truncated_ratio/train"] > 0 for m in metrics)


def launch(overrides: list[str], nproc: int = 2) -> subprocess.Popen:
    return subprocess.Popen(trainer_cmd(nproc, overrides), cwd=ROOT, env=trainer_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for_step(run, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").exists() and any(m["step"] >= step for m in read_jsonl(run / "metrics.jsonl")):
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (this test's unique run folder)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("when", ["mid_step", "start_up"])
def test_killing_the_agent_leaves_no_rank_behind(tmp_path, when):
    """SIGKILL of the torchrun agent, during training or while the ranks start: every rank is gone
    within 30 s (they were re-parented to PID 1 and kept training / retrying the store before)."""
    run = tmp_path / "run"
    proc = launch([f"trainer.save_dir={run}", "trainer.total_steps=100000", "trainer.save_freq=1", *SMALL])
    try:
        if when == "mid_step":
            wait_for_step(run, 1, proc)
        ranks: list[int] = []
        deadline = time.monotonic() + 60  # start-up: kill as soon as the ranks exist (imports, rendezvous)
        while not ranks and time.monotonic() < deadline and proc.poll() is None:
            ranks = [p for p in processes_mentioning(str(run)) if p != proc.pid]
            time.sleep(0.1)
        assert ranks, "no rank process found"
        if when == "start_up":
            assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()  # before step 1
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and processes_mentioning(str(run)):
            time.sleep(0.5)
        survivors = processes_mentioning(str(run))
        for pid in survivors:  # leave the machine clean even when the test fails
            os.kill(pid, signal.SIGKILL)
        assert not survivors, f"ranks {survivors} outlived their agent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_and_resumes_exactly(tmp_path):
    """SIGTERM to the agent mid-run (what a scheduler's preemption sends): the ranks finish the
    step, save it, log how to resume and exit without a traceback of their own; resuming from
    `latest` ends bit for bit where an uninterrupted run does."""
    from train.runtime.checkpoint import consolidate
    from test_trainer import assert_same

    steps = ["trainer.total_steps=6", "trainer.save_freq=6", *SMALL]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = launch([f"trainer.save_dir={straight}", *steps])
    assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
    proc = launch([f"trainer.save_dir={stopped}", *steps])
    wait_for_step(stopped, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    events = [e for e in read_jsonl(stopped / "trajectories.jsonl") if e["type"] == "stopped"]
    assert len(events) == 1 and events[0]["signal"] == "SIGTERM", out[-3000:]
    at = events[0]["step"]
    assert 2 <= at < 6 and (stopped / f"step{at}" / "COMPLETE").exists()
    assert f"stopped by SIGTERM after step {at}; resume with trainer.load_ckpt_from=latest" in out
    assert "Traceback" not in out.split("stopped by SIGTERM")[0]  # the ranks stopped cleanly
    proc = launch([f"trainer.save_dir={stopped}", "trainer.load_ckpt_from=latest", *steps])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert [m["step"] for m in read_jsonl(stopped / "metrics.jsonl")][-(6 - at):] == list(range(at + 1, 7))
    assert_same(consolidate(str(straight / "step6")), consolidate(str(stopped / "step6")))


def test_a_run_folder_belongs_to_one_run(tmp_path):
    """Starting again in a folder that holds a run is one clear line and changes nothing; with
    trainer.overwrite=true the old run is moved aside (not deleted) and the new one starts clean."""
    run = tmp_path / "run"
    first = launch([f"trainer.save_dir={run}", "trainer.total_steps=2", "trainer.save_freq=2", *SMALL], nproc=1)
    assert first.wait(timeout=300) == 0, first.stdout.read()[-3000:]
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    again = launch([f"trainer.save_dir={run}", "trainer.total_steps=2", "actor.lr=1e-3", *SMALL], nproc=1)
    out, _ = again.communicate(timeout=300)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert again.returncode != 0 and len(errors) == 1 and "already holds a run" in errors[0], out[-3000:]
    assert "trainer.load_ckpt_from=latest" in errors[0] and "trainer.overwrite=true" in errors[0]
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before  # nothing touched
    over = launch([f"trainer.save_dir={run}", "trainer.total_steps=1", "trainer.overwrite=true", *SMALL], nproc=1)
    out, _ = over.communicate(timeout=300)
    assert over.returncode == 0, out[-3000:]
    [aside] = list(tmp_path.glob("run.replaced-*"))
    assert (aside / "step2" / "COMPLETE").exists() and [m["step"] for m in read_jsonl(aside / "metrics.jsonl")] == [1, 2]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1] and not (run / "step2").exists()
    old_id = json.loads((aside / "run.json").read_text())["run_id"]
    assert json.loads((run / "run.json").read_text())["run_id"] != old_id


@pytest.mark.slow
def test_a_live_run_locks_its_folder_and_a_resume_repeats_no_step(tmp_path):
    """A second run cannot open a folder a live run holds; after the live run is killed, resuming
    from `latest` re-does the steps logged after that checkpoint instead of logging them twice."""
    run = tmp_path / "run"
    slow = tmp_path / "slow_env.py"  # >= 0.5 s per step, so the kill lands between two saves
    slow.write_text(f"import sys, time\nsys.path.insert(0, {str(ROOT / 'environments')!r})\n"
                    "from eq import reward_fn as _eq\n"
                    "def reward_fn(messages, answer):\n    time.sleep(0.5)\n    return _eq(messages, answer)\n")
    live = launch([f"trainer.save_dir={run}", "trainer.total_steps=100000", "trainer.save_freq=3",
                   f"rollout.env_path={slow}", "rollout.env_workers=16", *SMALL], nproc=1)
    try:
        wait_for_step(run, 1, live)
        other = launch([f"trainer.save_dir={run}", "trainer.load_ckpt_from=latest", *SMALL], nproc=1)
        out, _ = other.communicate(timeout=300)
        assert other.returncode != 0 and "is in use by a live run" in out, out[-3000:]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill just after a step that is not a checkpoint's
            steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
            if steps and steps[-1] > 3 and steps[-1] % 3 == 1:
                break
            time.sleep(0.05)
    finally:
        live.kill()
        live.wait()
    time.sleep(1.0)  # the ranks die with their agent (SIGKILL from the kernel)
    from train.runtime.checkpoint import find_latest

    saved = int(os.path.basename(find_latest(str(run)))[4:])
    logged = max(m["step"] for m in read_jsonl(run / "metrics.jsonl"))
    assert logged > saved  # steps after the checkpoint were logged before the kill
    total = logged + 1
    resumed = launch([f"trainer.save_dir={run}", "trainer.load_ckpt_from=latest", f"trainer.total_steps={total}",
                      *SMALL], nproc=1)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out[-3000:]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, total + 1))
    starts = json.loads((run / "run.json").read_text())["starts"]
    assert [s["resumed_from"] for s in starts] == [None, "latest"]


def test_the_export_is_replaced_in_one_atomic_step(tmp_path, monkeypatch):
    """`latest/` is swapped with its new version in one renameat2(RENAME_EXCHANGE): no moment (and no
    crash) leaves only `latest.old` and `latest.tmp` behind, as the two-rename version could."""
    from train.runtime import checkpoint

    final, tmp = tmp_path / "latest", tmp_path / "latest.tmp"
    final.mkdir()
    (final / "model.safetensors").write_text("old")
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("new")

    def no_two_step_rename(*args):
        raise AssertionError(f"os.rename{args}: a crash after it would leave no `latest`")

    monkeypatch.setattr(checkpoint.os, "rename", no_two_step_rename)
    checkpoint._replace_dir(str(tmp), str(final))
    assert (final / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_runs_that_cannot_learn_say_so(tmp_path):
    """Greedy training samples identical responses: a start-up warning, a warning at the first step that
    made no update (none has yet), one once `trainer.warn_skipped_steps` steps in a row made none, and a
    last line saying nothing was learned (these runs used to exit 0 with only `actor/skipped` in the metrics)."""
    run = tmp_path / "run"
    proc = launch([f"trainer.save_dir={run}", "rollout.train_sampling_params.temperature=0", "trainer.total_steps=3",
                   "trainer.warn_skipped_steps=2", "data.prompts_per_rollout=4", "data.responses_per_prompt=4",
                   "trainer.test_freq=null", "trainer.progress_bar=false"], nproc=1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "warning: rollout.train_sampling_params.temperature=0 samples greedily" in out
    # the first skipped step of a run that has not updated yet is named at once (a 1-step run's closing
    # line used to point at warnings that only start after warn_skipped_steps steps)
    assert "warning: step 1 made no update: every group's rewards were identical" in out
    assert "warning: no update in the last 2 steps (up to step 2)" in out
    assert "warning: this run made no update in its 3 steps" in out
    warnings = [e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "warning"]
    assert len(warnings) == 3


@pytest.mark.parametrize("governor", [slow(False), True])
def test_a_huge_learning_rate_is_reported_or_rolled_back(tmp_path, governor):
    """actor.lr=1e3 blew the weights up to ~1000 at step 1 and the run went on with a reward of 0 while
    every metric stayed finite. The update's relative weight-norm change is watched from the first
    step: without the governor a warning names it, with it the update is rolled back and never pushed."""
    run = tmp_path / "run"
    proc = launch([f"trainer.save_dir={run}", "actor.lr=1e3", "trainer.total_steps=2",
                   f"trainer.governor.enable={str(governor).lower()}", *SMALL], nproc=1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    assert rows[1]["actor/weight_change"] > 10  # the weight norm grew by over 1000%
    if governor:
        assert "step 1: governor rolled back (actor/weight_change" in out, out[-3000:]
        assert rows[1]["governor/rollback"] == 1.0 and "time/weight_sync_s" not in rows[1]
        rollback = next(e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "governor.rollback")
        assert rollback["bad_fingerprint"] > 10 * rollback["restored_fingerprint"]  # sum|w| before / after
        assert rows[2]["governor/rollback"] == 1.0  # the same lr blows up again: rolled back again
        # every update was rolled back: the closing line says so and why (it used to say nothing)
        assert ("warning: this run made no update in its 2 steps: nothing was learned (2 step(s) rolled back by "
                "the governor (the 'governor rolled back' lines above, governor/rollback))") in out, out[-3000:]
    else:
        assert "warning: step 1's update changed the actor's weight norm by" in out
        assert "trainer.governor.enable=true rolls such updates back" in out


# the escalated case asserts the warning too: warn alone runs in the slow set
@pytest.mark.parametrize("escalate", [slow(False, id="warn"), pytest.param(True, id="governor")])
def test_a_health_alarm_names_step_rule_and_value_and_can_hold_the_update(tmp_path, escalate):
    """A rule made to hold on every step (an entropy floor of 1000 nats): the run names it in a warning once it held
    `patience` steps; escalated, the governor holds that update and rolls it back (min_panics=1) before a push."""
    run = tmp_path / "run"
    gate = ["trainer.health.escalate=governor", "trainer.governor.enable=true"] if escalate else []
    proc = launch([f"trainer.save_dir={run}", "trainer.total_steps=3", "trainer.health.entropy_floor=1000",
                   "trainer.health.patience=2", *gate, *SMALL], nproc=1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    assert [rows[s]["health/alarms"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert "step 2: health: entropy: actor/entropy" in out and "< 1000 for 2 steps" in out, out[-3000:]
    event = next(e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "health.alarm")
    assert event["step"] == 2 and event["rule"] == "entropy"
    if escalate:
        assert rows[2]["governor/rollback"] == 1.0 and "time/weight_sync_s" not in rows[2]
        assert rows[1]["governor/rollback"] == 0.0 and rows[3]["governor/rollback"] == 0.0
        assert "step 2: governor rolled back (health: entropy:" in out
    else:
        assert "time/weight_sync_s" in rows[2]


# the rollback case asserts the warning too: warn alone runs in the slow set
@pytest.mark.parametrize("action", [slow("warn", id="warn"), "rollback"])
def test_a_forgotten_held_out_set_is_said_and_can_be_rolled_back(tmp_path, action):
    """actor.lr=1e3 wrecks the stub at step 1: its held-out test reward falls from 0.27 to ~0. The forgetting gate
    names the metric and the drop; with action=rollback the weights of the step-0 evaluation come back (the
    final export equals the stub model itself, tensor for tensor) and are pushed."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    proc = launch([f"trainer.save_dir={run}", "actor.lr=1e3", "trainer.total_steps=1", "trainer.test_freq=1",
                   "trainer.forgetting.watch=[rewards/test]", f"trainer.forgetting.action={action}",
                   "data.prompts_per_rollout=4", "data.responses_per_prompt=4", "rollout.dynamic_filtering=false",
                   "trainer.progress_bar=false"], nproc=1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    assert rows[0]["forgetting/alarm"] == 0.0 and rows[1]["forgetting/alarm"] == 1.0
    assert "warning: step 1: forgetting: rewards/test" in out and "below its first evaluation's" in out
    exported, stub = load_file(run / "latest" / "model.safetensors"), load_file(ROOT / "stub/model/model.safetensors")
    same = all(torch.equal(exported[k], stub[k]) for k in stub)
    if action == "rollback":
        assert rows[1]["forgetting/rollback"] == 1.0 and "rolled back to step 0's evaluation" in out
        assert same
    else:
        assert "forgetting/rollback" not in rows[1] and not same


def test_forgetting_can_raise_the_kl_coefficient_and_a_resume_keeps_it_raised(tmp_path):
    """trainer.forgetting.action=raise_kl: each evaluation that shows forgetting doubles actor.kl.coef for the
    updates after it (the loss's KL term uses it: actor/kl_coef); the raised value is in the checkpoint."""
    common = ["actor.lr=1e3", "actor.kl.coef=0.01", "trainer.total_steps=3", "trainer.test_freq=1",
              "trainer.forgetting.watch=[rewards/test]", "trainer.forgetting.action=raise_kl", "trainer.save_freq=2",
              "data.prompts_per_rollout=4", "data.responses_per_prompt=4", "rollout.dynamic_filtering=false",
              "trainer.progress_bar=false"]
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    proc = launch([f"trainer.save_dir={run}", *common], nproc=1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    assert [rows[s]["actor/kl_coef"] for s in (1, 2, 3)] == pytest.approx([0.01, 0.02, 0.04])
    assert rows[1]["forgetting/kl_coef"] == pytest.approx(0.02) and "actor.kl.coef raised to 0.02" in out
    proc = launch([f"trainer.save_dir={resumed}", f"trainer.load_ckpt_from={run / 'step2'}", *common], nproc=1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert read_jsonl(resumed / "metrics.jsonl")[0]["actor/kl_coef"] == pytest.approx(0.04)


def test_a_group_of_one_with_a_group_baseline_is_flagged():
    from conftest import compose_config
    from train.trainer.config import useless_settings

    assert useless_settings(compose_config()) == []
    [warning] = useless_settings(compose_config(["data.responses_per_prompt=1"]))
    assert "data.responses_per_prompt=1 with adv.estimator=reinforce" in warning
    assert useless_settings(compose_config(["data.responses_per_prompt=1", "adv.global_norm=true"])) == []
    # distillation: the teacher's per-token advantage is not a group baseline, a group of one learns
    assert useless_settings(compose_config(["data.responses_per_prompt=1", "distill.teacher=stub/model"])) == []


BLOCKING_ENV = """
import time

async def reward_fn(messages, answer):
    time.sleep(600)  # blocks the event loop: rollout.env_timeout_s cannot interrupt it
    return 1.0
"""


def test_the_watchdog_names_a_hung_phase_and_the_blocking_env(tmp_path):
    """An async reward_fn that blocks the event loop used to hang the run silently; the watchdog ends
    the rank after trainer.watchdog_min_s with a line naming the phase and the env call, and every
    thread's stack (the sleeping env frame among them), also written to the run folder."""
    env = tmp_path / "blocking_env.py"
    env.write_text(textwrap.dedent(BLOCKING_ENV))
    run = tmp_path / "run"
    start = time.monotonic()
    proc = launch([f"trainer.save_dir={run}", f"rollout.env_path={env}", "trainer.total_steps=2",
                   "trainer.watchdog_min_s=3", *SMALL], nproc=1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.monotonic() - start < 90, out[-3000:]
    assert "watchdog: rank 0: rollout has run for" in out, out[-3000:]
    assert "env call in flight the longest: blocking_env.py:reward_fn for" in out
    dump = (run / "watchdog_rank0.txt").read_text()
    assert "blocking_env.py" in dump and "reward_fn" in dump  # the blocked frame is in the stacks


def test_watchdog_limits_follow_each_phase_history():
    from train.runtime.watchdog import Watchdog

    dog = Watchdog(None, 10.0, 0, ".")  # min_s None: only phases with a fixed limit are judged
    assert dog.limit("update") == float("inf") and dog.limit("weight push", 600.0) == 600.0
    dog.min_s = 5.0
    assert dog.limit("update") == 5.0
    dog.longest["update"] = 2.0
    assert dog.limit("update") == 20.0 and dog.limit("rollout") == 5.0
    dog.close()


COLLECTIVE_TIMEOUT = """
import sys, time
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
from train.parallel.distributed import init_distributed
from train.parallel.layout import build_layout

ctx = init_distributed(3)
layout = build_layout(ctx.world_size, "cpu", prefix="actor", timeout_s=ctx.collective_timeout_s)
for dim in ("ddp", "fsdp", "tp"):  # sub-groups too, not only the world group
    timeout = layout.model_mesh.get_group(dim)._get_backend(torch.device("cpu")).options._timeout
    assert timeout.total_seconds() == 3, (dim, timeout)
if ctx.rank == 1:
    time.sleep(8)  # never joins: rank 0 must give up after trainer.collective_timeout_s, not 30 minutes
    sys.exit(0)
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except Exception as e:
    print(f"timed out after {{time.monotonic() - start:.1f}} s: {{type(e).__name__}}", flush=True)
"""


def test_collectives_time_out_after_the_configured_seconds(tmp_path):
    script = tmp_path / "collective_timeout.py"
    script.write_text(COLLECTIVE_TIMEOUT.format(root=str(ROOT)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=trainer_env())
    line = next((l for l in proc.stdout.splitlines() if l.startswith("timed out after")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert 2.5 < float(line.split()[3]) < 15, line  # 3 s, not gloo's default 1800 s


@pytest.mark.skipif(not can_mount_in_a_namespace(), reason="needs unshare -rm (user + mount namespaces) for a small tmpfs")
def test_a_full_disk_is_said_in_words(tmp_path):
    """A checkpoint that does not fit used to fail with `enforce fail at inline_container.cc` and a
    traceback. Here the run folder is a 3 MiB tmpfs (the stub's first checkpoint needs ~10 MiB)."""
    run = tmp_path / "run"
    run.mkdir()
    cmd = " ".join(trainer_cmd(1, [f"trainer.save_dir={run}", "trainer.total_steps=2", "trainer.save_freq=1", *SMALL]))
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=3m tmpfs {run} && exec {cmd}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=trainer_env())
    assert proc.returncode != 0
    err = proc.stderr
    assert f"no space left on the device holding {run}/step1.tmp while writing the checkpoint of step 1" in err, err[-3000:]
    assert "MiB free" in err and "trainer.load_ckpt_from=latest" in err
