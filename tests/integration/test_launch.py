"""`python -m train.launch` and the cluster recipes: a preempted run exits 143 (SIGTERM) or 130 (SIGINT)
with no traceback once its ranks saved, never 0 (finished) nor torchrun's SignalException exit 1; a rank
that fails keeps its failure report; scripts/slurm/grpo.sbatch maps SLURM's variables to the rendezvous."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port, read_jsonl, trainer_env

# A rank without the trainer: it says it is ready, waits (bounded) for SIGTERM / SIGINT, then does what
# FAKE_RANK_MODE says. Seconds per launch instead of a model load.
FAKE_RANK = """
import os, signal, sys, time
from train.runtime.lifecycle import tell_launcher

mode, got = os.environ["FAKE_RANK_MODE"], []
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN if mode == "hang" else (lambda s, f: got.append(s)))
with open(os.path.join(os.environ["READY_DIR"], os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 120
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
if not got:
    sys.exit(9)  # no signal came: the test failed to send it
if mode == "saves":  # what the trainer does: the ranks agree, note it for the launcher, save, exit 0
    tell_launcher(signal.Signals(got[0]).name)
    sys.exit(0)
if mode == "fails":  # the save failed
    sys.exit(3)
sys.exit(0)  # "finishes": the signal came during the last step, the run is complete
"""


def wait_for(what: str, ready, proc: subprocess.Popen, timeout: float = 120):
    """Poll `ready()` until it is truthy; fail naming `what` after `timeout` s or if `proc` ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the launch ended ({proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout} s")


def fake_launch(tmp_path: Path, mode: str, *launch_args: str,
                env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[int]]:
    """train.launch with two fake ranks (`env`: more environment); (the agent, the ranks' pids) once both are ready."""
    script, ready = tmp_path / "rank.py", tmp_path / "ready"
    script.write_text(textwrap.dedent(FAKE_RANK))
    ready.mkdir()
    env = {**trainer_env(), "FAKE_RANK_MODE": mode, "READY_DIR": str(ready), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node=2",
                             *launch_args, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for("two ready ranks", lambda: len(list(ready.iterdir())) == 2, proc)
    return proc, [int((ready / r).read_text()) for r in ("0", "1")]


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_the_ranks_saved_exits_128_plus_the_signal_without_a_traceback(tmp_path, sig, code):
    """Before: torchrun's SignalException, a 25-line traceback and exit 1 after the ranks had saved."""
    proc, _ = fake_launch(tmp_path, "saves")
    proc.send_signal(sig)
    rc, err = finish(proc)
    assert rc == code, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert f"train.launch: the ranks stopped on {sig.name} at a step boundary; exit {code}" in err


def test_a_rank_that_fails_after_the_signal_keeps_the_failure_report(tmp_path):
    proc, _ = fake_launch(tmp_path, "fails")
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == 1 and "ChildFailedError" in err and "exitcode  : 3" in err, err[-3000:]
    assert "stopped on" not in err


def test_a_signal_during_the_last_step_of_a_finished_run_exits_0(tmp_path):
    """The ranks finished (no stop was agreed): nothing to resume, so 0, not a requeue code."""
    proc, _ = fake_launch(tmp_path, "finishes")
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == 0, err[-3000:]


def test_ranks_signalled_directly_stop_the_launch_with_143(tmp_path):
    """SLURM signals every process of the step; Kubernetes stops one pod while the ranks of the others
    agree to stop through the all-reduce: every node's launcher exits 143, whether its agent got the
    signal or not."""
    proc, ranks = fake_launch(tmp_path, "saves")
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == 143, err[-3000:]


def test_ranks_that_do_not_stop_are_killed_after_the_shutdown_timeout(tmp_path):
    from torch.distributed.run import get_args_parser

    # torchrun's flag where it has one (not 2.11), else the variable that is its default
    flag = any("--shutdown-timeout" in a.option_strings for a in get_args_parser()._actions)
    proc, _ = fake_launch(tmp_path, "hang", *(["--shutdown-timeout=2"] if flag else []),
                          env={} if flag else {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"})
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc, timeout=60)
    assert rc == 1, err[-3000:]
    assert "error: the ranks did not stop within 2 s of SIGTERM (torchrun --shutdown-timeout" in err


def test_a_stop_before_any_rank_started_exits_143_without_a_traceback(tmp_path):
    """SIGTERM while the agent waits in the rendezvous for a second node: nothing to save, no traceback."""
    port = free_port()
    script = tmp_path / "rank.py"
    script.write_text("raise SystemExit(9)  # never started: the second node does not come\n")
    proc = subprocess.Popen([sys.executable, "-m", "train.launch", "--nnodes=2", "--nproc_per_node=1",
                             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(script)], cwd=ROOT,
                            env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def listening() -> bool:  # the agent hosts the rendezvous store: it is waiting there
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for("the agent's rendezvous store", listening, proc)
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == 143, err[-3000:]
    assert "Traceback" not in err and "train.launch: stopped by SIGTERM while no rank was running; exit 143" in err


def test_a_preempted_trainer_exits_143_and_resumes_from_the_saved_step(tmp_path):
    """A real 2-rank stub run under train.launch: SIGTERM to the agent after step 1; the ranks save,
    the launch exits 143 with no traceback; `trainer.load_ckpt_from=latest` goes on from that step."""
    run = tmp_path / "run"
    steps = ["trainer.total_steps=4", "trainer.save_freq=4", "data.prompts_per_rollout=4",
             "data.responses_per_prompt=4", "rollout.dynamic_filtering=false", "trainer.test_freq=null",
             "trainer.progress_bar=false", f"trainer.save_dir={run}"]

    def launch(*extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node=2",
                                 "-m", "train.trainer.grpo", "--config-name", "stub", *steps, *extra], cwd=ROOT,
                                env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    proc = launch()
    wait_for("step 1 in metrics.jsonl", lambda: (run / "metrics.jsonl").exists()
             and any(m["step"] >= 1 for m in read_jsonl(run / "metrics.jsonl")), proc, timeout=300)
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc, timeout=120)
    assert rc == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    [stopped] = [e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "stopped"]
    at = stopped["step"]
    assert 1 <= at < 4 and (run / f"step{at}" / "COMPLETE").exists()
    assert "train.launch: the ranks stopped on SIGTERM at a step boundary; exit 143" in err
    proc = launch("trainer.load_ckpt_from=latest")
    rc, err = finish(proc, timeout=300)
    assert rc == 0, err[-3000:]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")][-(4 - at):] == list(range(at + 1, 5))


# --- the pre-flight check refuses a folder that holds a run -----------------------------------------

@pytest.mark.slow
def test_the_pre_flight_check_refuses_a_folder_that_holds_a_run_as_the_trainer_does(tmp_path):
    """launch_grpo.sh's check passed such a folder and torchrun failed 9 s later; now the check
    stops it with the trainer's own line (train/runtime/run_folder.py), and a resume passes."""
    from train.runtime.run_folder import RunFolderError, replaces_a_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"run_id": "x", "starts": []}')
    with pytest.raises(RunFolderError) as trainer_says:
        replaces_a_run(str(run), None, False)
    env = {**trainer_env(), "SAVE_DIR": str(run), "DRY_RUN": "1"}
    proc = subprocess.run(["bash", "launch_grpo.sh", "trainer.total_steps=1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"error: {trainer_says.value}"]
    assert "train.launch" not in proc.stdout  # nothing launched
    for ok in ("trainer.load_ckpt_from=latest", "trainer.overwrite=true"):
        proc = subprocess.run(["bash", "launch_grpo.sh", ok], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0 and "-m train.launch" in proc.stdout, proc.stderr[-3000:]


# --- the SLURM recipe, under a simulated SLURM ---------------------------------------------------------

FAKE_SRUN = """#!/usr/bin/env bash
# srun for one step of SLURM_JOB_NUM_NODES tasks, one per node, run one after the other
touch "$FAKE_DIR/srun.started"
if [ -n "${FAKE_SRUN_GATE:-}" ]; then
  for _ in $(seq 1200); do [ -f "$FAKE_SRUN_GATE" ] && break; sleep 0.05; done
fi
while [[ "$1" == -* ]]; do shift; done
for ((n = 0; n < SLURM_JOB_NUM_NODES; n++)); do
  SLURM_NODEID=$n SLURM_PROCID=$n "$@" > "$FAKE_DIR/task$n.out" 2> "$FAKE_DIR/task$n.err"
done
exit "${FAKE_SRUN_RC:-0}"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_DIR/scontrol.log"
if [ "$1 $2 $3" = "show hostnames gpu[017-018]" ]; then printf 'gpu017\\ngpu018\\n'; exit 0; fi
[ "$1" = requeue ] || exit 1
"""


def slurm(tmp_path: Path, *args: str, **env: str) -> subprocess.Popen:
    """scripts/slurm/grpo.sbatch as sbatch runs it, with fake srun / scontrol and a 2-node allocation;
    launch_grpo.sh prints each node's command (DRY_RUN) instead of training. Its output: fake/sbatch.out."""
    bin_dir, fake = tmp_path / "bin", tmp_path / "fake"
    bin_dir.mkdir(exist_ok=True)
    fake.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    full = {**trainer_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(fake),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[017-018]", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_GPUS_ON_NODE": "8", "SLURM_SUBMIT_DIR": str(ROOT), "DRY_RUN": "1", "PREFLIGHT": "0",
            "PYTHON_BIN": sys.executable, **env}
    with open(fake / "sbatch.out", "w") as out:
        return subprocess.Popen(["bash", str(ROOT / "scripts/slurm/grpo.sbatch"), *args], cwd=tmp_path, env=full,
                                stdout=out, stderr=subprocess.STDOUT, text=True)


def sbatch_result(tmp_path: Path, proc: subprocess.Popen) -> tuple[int, str]:
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, (tmp_path / "fake" / "sbatch.out").read_text()


def node_commands(tmp_path: Path) -> list[list[str]]:
    import shlex

    out = []
    for n in (0, 1):
        text = (tmp_path / "fake" / f"task{n}.out").read_text()
        assert text.strip(), (tmp_path / "fake" / f"task{n}.err").read_text()
        out.append(shlex.split(text))
    return out


def test_the_slurm_script_gives_each_node_the_c10d_rendezvous(tmp_path):
    rc, out = sbatch_result(tmp_path, slurm(tmp_path, "actor.lr=1e-6"))
    assert rc == 0, out
    for n, words in enumerate(node_commands(tmp_path)):
        assert words[:3] == [sys.executable, "-m", "train.launch"]
        assert words[3:13] == ["--nnodes", "2", "--node_rank", str(n), "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", "gpu017:19242", "--nproc_per_node", "8"]  # 15000 + 4242
        assert words[13:] == ["-m", "train.trainer.grpo", "--config-name", "stub", "trainer.save_dir=runs/stub",
                              "actor.lr=1e-6"]  # a first start: a folder holding a run is refused
    assert "requeue" not in (tmp_path / "fake" / "scontrol.log").read_text()


def test_a_requeued_slurm_job_resumes_from_latest(tmp_path):
    rc, out = sbatch_result(tmp_path, slurm(tmp_path, "actor.lr=1e-6", SLURM_RESTART_COUNT="1"))
    assert rc == 0, out
    assert all(w[-2:] == ["trainer.load_ckpt_from=latest", "actor.lr=1e-6"] for w in node_commands(tmp_path))


def test_a_preempted_slurm_job_survives_the_signal_and_requeues_itself(tmp_path):
    """SIGTERM reaches the batch shell too (a preemption): it keeps waiting for srun instead of dying
    with the steps; srun's 143 (the ranks saved) requeues the job."""
    gate = tmp_path / "gate"
    proc = slurm(tmp_path, FAKE_SRUN_RC="143", FAKE_SRUN_GATE=str(gate))
    wait_for("srun to start", lambda: (tmp_path / "fake" / "srun.started").exists(), proc)
    proc.send_signal(signal.SIGTERM)
    wait_for("the batch shell's trap", lambda: "waiting for the ranks to save" in
             (tmp_path / "fake" / "sbatch.out").read_text(), proc, timeout=60)
    gate.touch()  # srun (the ranks) ends after the signal
    rc, out = sbatch_result(tmp_path, proc)
    assert rc == 143, out
    assert (tmp_path / "fake" / "scontrol.log").read_text().splitlines()[-1] == "requeue 4242"


def test_a_failed_slurm_job_is_not_requeued(tmp_path):
    rc, out = sbatch_result(tmp_path, slurm(tmp_path, FAKE_SRUN_RC="2"))
    assert rc == 2, out
    assert "requeue" not in (tmp_path / "fake" / "scontrol.log").read_text()


def test_the_slurm_mapping_names_what_is_missing():
    from train.utils.cluster import ClusterError, slurm_launch_env

    base = {"SLURM_JOB_ID": "77_3", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
            "SLURM_GPUS_ON_NODE": "4"}
    hosts = lambda nodelist: ["n1", "n2"]  # noqa: E731
    assert slurm_launch_env(base, hosts) == {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "n1",
                                             "MASTER_PORT": "15077", "NPROC": "4"}
    assert slurm_launch_env({**base, "MASTER_PORT": "29500", "NPROC": "2"}, hosts)["MASTER_PORT"] == "29500"
    for change, message in ((dict(SLURM_NODEID=None), "SLURM_NODEID is not set"),
                            (dict(SLURM_JOB_NUM_NODES="3"), "names 2 host(s) but SLURM_JOB_NUM_NODES=3"),
                            (dict(SLURM_GPUS_ON_NODE=None), "set NPROC"),
                            (dict(SLURM_NODEID="x"), "SLURM_NODEID='x' is not a whole number")):
        env = {k: v for k, v in {**base, **change}.items() if v is not None}
        with pytest.raises(ClusterError, match=re.escape(message)):
            slurm_launch_env(env, hosts)
