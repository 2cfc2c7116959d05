"""Dedicated rollout ranks (rollout.ranks=K, issue 17): the last K torchrun ranks only generate and score,
the others only train; weights are broadcast to them in flat buckets and samples streamed back.

A run with one trainer rank and one rollout rank trains exactly as one rank with its engine in-process
(the same samples, weights and Adam moments, bit for bit); two trainer ranks served by one rollout rank
train one-step-off and resume bit-exactly across an epoch boundary; a stuck side times out naming the
step; a stuck or stopped rollout rank ends the run with one line naming both ranks, the request, what
the rollout rank was in (or that it stopped answering) and the timeout; config mistakes are refused."""
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, compose_config, free_port, read_jsonl, run_trainer, trainer_env
from test_async import metrics_by_step
from test_trainer import assert_same, prompts_by_step
from train.runtime.checkpoint import consolidate

SMALL = ["data.prompts_per_rollout=4", "data.responses_per_prompt=4", "rollout.dynamic_filtering=false",
         "trainer.test_freq=2", "trainer.log_samples=100", "trainer.num_threads=1"]


def run(save, data, steps: int, *overrides: str, nproc: int = 1):
    run_trainer([f"trainer.save_dir={save}", f"data.train_data_path={data}", f"trainer.total_steps={steps}",
                 *SMALL, *overrides], nproc=nproc)
    return save


def test_one_trainer_and_one_rollout_rank_train_as_one_rank_with_its_own_engine(small_data, tmp_path):
    """The rollout rank receives every push (checksums verified: trainer.verify_push), tags samples
    with the pushed version, and serves the evaluations; nothing differs from the in-process engine."""
    alone = run(tmp_path / "alone", small_data, 4, "trainer.save_freq=4", "trainer.sync_probe_every=2")
    split = run(tmp_path / "split", small_data, 4, "trainer.save_freq=4", "trainer.sync_probe_every=2",
                "rollout.ranks=1", nproc=2)
    assert_same(consolidate(str(alone / "step4")), consolidate(str(split / "step4")))
    a, b = metrics_by_step(alone), metrics_by_step(split)
    for step in range(1, 5):
        assert b[step]["rewards/train"] == a[step]["rewards/train"]
        assert b[step]["actor/sampler_kl"] == a[step]["actor/sampler_kl"]
        assert b[step]["rollout/tokens"] == a[step]["rollout/tokens"] > 0
        assert "time/weight_sync_s" in b[step]
    assert [b[s]["rewards/test"] for s in (0, 2, 4)] == [a[s]["rewards/test"] for s in (0, 2, 4)]
    # the sync probe: the rollout rank's engine scores it as the in-process engine does
    assert b[2]["engine/probe_abs_diff"] == a[2]["engine/probe_abs_diff"] < 1e-3
    samples = [e for e in read_jsonl(split / "trajectories.jsonl") if e["type"] == "sample"]
    assert samples and all(s["turn_versions"] == [s["step"] - 1] * s["n_turns"] for s in samples)
    layout = next(e for e in read_jsonl(split / "trajectories.jsonl") if e["type"] == "layout")
    assert layout["world_size"] == 1 and layout["rollout_ranks"] == 1


SERVED = ["trainer.save_freq=3", "rollout.ranks=1", "rollout.max_staleness=1", "rollout.bucket_size_mb=0.5"]


@pytest.fixture(scope="module")
def served_async(tmp_path_factory, small_data):
    """Two trainer ranks served by one rollout rank, one-step-off, 6 steps over 2.4 epochs; pushes in
    buckets of 0.5 MB (the stub's 3.2 MB of weights: several broadcasts per push)."""
    return run(tmp_path_factory.mktemp("served"), small_data, 6, *SERVED, nproc=3)


@pytest.mark.slow
def test_two_trainer_ranks_one_step_off_on_one_rollout_rank(served_async):
    metrics = metrics_by_step(served_async)
    assert [metrics[s]["async/staleness_max"] for s in range(1, 7)] == [0.0] + [1.0] * 5
    samples = [e for e in read_jsonl(served_async / "trajectories.jsonl") if e["type"] == "sample"]
    assert {s["rank"] for s in samples} == {0, 1}  # both trainer ranks' samples came back
    assert all(s["turn_versions"] == [max(s["step"] - 2, 0)] * s["n_turns"] for s in samples)
    assert all(metrics[s]["actor/sampler_kl"] > 1e-5 for s in range(2, 7))


@pytest.mark.slow
def test_a_resume_with_rollout_ranks_is_exact_across_an_epoch_boundary(served_async, small_data, tmp_path):
    resumed = run(tmp_path / "resumed", small_data, 6, *SERVED, f"trainer.load_ckpt_from={served_async / 'step3'}",
                  nproc=3)
    assert_same(consolidate(str(served_async / "step6")), consolidate(str(resumed / "step6")))
    straight, again = prompts_by_step(served_async), prompts_by_step(resumed)
    assert sorted(again) == [4, 5, 6] and all(again[s] == straight[s] for s in (4, 5, 6))


@pytest.mark.slow
def test_a_stuck_rollout_rank_ends_the_run_with_one_line_naming_rank_peer_request_and_env_call(small_data, tmp_path):
    """One-step-off: step 2's rollout is stuck in an env call on the rollout rank past
    rollout.async_timeout_s. The trainer's wait for its samples times out (closing the gloo link); the
    weight push after step 1, which waits for that rollout's generation, stops with that error instead
    of sending over the dead link: one `error:` line names this rank, the peer, the request, the env
    call the rollout rank was in, and the timeout key with its value; no raw gloo error ("Application
    timeout caused pair closure") and no traceback of the trainer's.
    The rollout rank, once its env call times out, finds its trainer gone and says so."""
    env = tmp_path / "stuck_env.py"
    # the first reward of step 2's rollout hangs; the rollout rank keeps serving through torchrun's
    # SIGTERM (trainer ranks may need it to finish a step) and exits when rollout.env_timeout_s ends it
    env.write_text("import time\n\ncalls = 0\n\n\ndef reward_fn(messages, answer):\n    global calls\n"
                   "    calls += 1\n    if calls == 17:\n        time.sleep(60)\n    return 0.0\n")
    proc = run_trainer([f"trainer.save_dir={tmp_path / 'run'}", f"data.train_data_path={small_data}",
                        "trainer.total_steps=3", *SMALL, "trainer.test_freq=null", f"rollout.env_path={env}",
                        "rollout.env_timeout_s=15", "rollout.async_timeout_s=10", "rollout.ranks=1",
                        "rollout.max_staleness=1"], nproc=2, check=False, timeout=300)
    assert proc.returncode != 0
    trainer = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 0:")]
    assert len(trainer) == 1, proc.stderr[-4000:]
    line = trainer[0]
    for part in ("trainer rank 0 waited 10 s for the samples of step 2's rollout from rollout rank 1",
                 "rollout rank 1 was serving step 2's rollout", "stuck_env.py:reward_fn for ",
                 "(rollout.async_timeout_s=10: raise it"):
        assert part in line, line
    assert "Application timeout" not in proc.stderr and "Error executing job" not in proc.stderr
    assert "rollout_bridge.py" not in proc.stderr  # no traceback through the bridge
    rollout = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 1:")]
    assert rollout and "rollout rank 1 lost trainer rank 0 while waiting to send the samples of step 2's rollout" \
        in rollout[0], proc.stderr[-4000:]


STOPPED_RANK = """
import sys, time
from train.parallel.rollout_bridge import STATUS_EVERY_S, BridgeError, split_world
from train.workers.rollout_server import StatusBeacon

split, bridge = split_world(1, "gloo", 4.0)
if split.is_rollout:
    beacon = StatusBeacon(bridge)
    beacon.phase = "serving step 2's rollout"
    time.sleep(3 * STATUS_EVERY_S)  # the phase is published
    print("serving", flush=True)
    time.sleep(120)  # (SIGSTOPped here)
else:
    import torch

    bucket = torch.zeros(64 << 20, dtype=torch.uint8)  # more than the sockets' buffers hold
    sys.stdin.readline()  # the test says when rank 1 is stopped: the wait starts after it (a loaded machine)
    for push in (lambda: bridge.broadcast(bucket, "step 3's weight push, bucket 1 of 1 (67108864 bytes)"),
                 lambda: bridge.send({"kind": "stop"}, 1, "the stop request")):
        try:
            push()
        except BridgeError as e:
            print("error:", e, flush=True)
"""


def test_a_stopped_rollout_rank_is_named_as_stopped_answering():
    """A SIGSTOPped rollout rank publishes no status: trainer rank 0's weight broadcast times out
    saying it stopped answering and what it last said it was doing; a later send on the failed bridge
    repeats that cause (not gloo's raw "Application timeout caused pair closure")."""
    env = {**trainer_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    ranks = [subprocess.Popen([sys.executable, "-c", STOPPED_RANK], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        assert ranks[1].stdout.readline().strip() == "serving", ranks[1].stderr.read()[-3000:]
        os.kill(ranks[1].pid, signal.SIGSTOP)
        out, err = ranks[0].communicate("stopped\n", timeout=120)
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 2, out + err[-3000:]
    first = ("trainer rank 0 waited 4 s for rollout rank 1 to take step 3's weight push, bucket 1 of 1 (67108864 bytes); "
             "rollout rank 1 stopped answering: its last status, ")
    assert first in lines[0] and "said it was serving step 2's rollout" in lines[0], lines[0]
    assert "(rollout.async_timeout_s=4: raise it" in lines[0]
    assert lines[1].startswith(lines[0]) and lines[1].endswith(
        "so trainer rank 0 stopped waiting to send the stop request to rollout rank 1"), lines[1]


def test_bad_rollout_ranks_are_refused():
    from train.trainer.config import ConfigError, rollout_ranks

    assert rollout_ranks(compose_config([]), 1) == 0
    assert rollout_ranks(compose_config(["rollout.ranks=2"]), 4) == 2
    for bad in ("-1", "1.5", "true"):
        with pytest.raises(ConfigError, match="rollout.ranks.*integer >= 0"):
            rollout_ranks(compose_config([f"rollout.ranks={bad}"]), 2)
    with pytest.raises(ConfigError, match="need at least as many trainer ranks.*--nproc_per_node=4"):
        rollout_ranks(compose_config(["rollout.ranks=2"]), 3)
    with pytest.raises(ConfigError, match="hf engine only"):
        rollout_ranks(compose_config(["rollout.ranks=1", "rollout.engine=sglang"]), 2)
    with pytest.raises(ConfigError, match="LoRA"):
        rollout_ranks(compose_config(["rollout.ranks=1", "actor.lora.rank=4"]), 2)
    # the pre-flight check (launch_grpo.sh) validates for the trainer ranks: 3 prompts fit 1 trainer rank
    from train.trainer.config import check

    check("stub", ["trainer.save_dir=unused", "rollout.ranks=1", "data.prompts_per_rollout=3"], 2)
    with pytest.raises(ConfigError, match="not divisible by the 2 data-parallel ranks"):
        check("stub", ["trainer.save_dir=unused", "data.prompts_per_rollout=3"], 2)
