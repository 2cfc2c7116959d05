"""Rollouts ahead of the update (rollout.max_staleness=1 and 2, issue 17): the staleness bound, version tags,
importance sampling against the sampler's log-probs, exact resume (also across an epoch boundary and
onto another world size without losing or repeating prompts), and waits that time out with a message."""
import threading
import time
from collections import Counter

import pytest

from conftest import read_jsonl, run_trainer
from test_trainer import _flatten, assert_same, prompts_by_step
from train.runtime.checkpoint import consolidate
from train.trainer.prefetch import RolloutPrefetcher, RolloutTimeout, StepRollout, staleness

ASYNC = ["rollout.max_staleness=1", "data.prompts_per_rollout=4", "data.responses_per_prompt=4",
         "rollout.dynamic_filtering=false", "trainer.test_freq=null", "trainer.log_samples=100"]


def run_async(save, data, steps: int, *overrides: str, nproc: int = 1):
    """`steps` asynchronous steps (the ASYNC settings, then `overrides`) on `data` into `save`."""
    run_trainer([f"trainer.save_dir={save}", f"data.train_data_path={data}", f"trainer.total_steps={steps}", *ASYNC,
                 *overrides], nproc=nproc)
    return save


def metrics_by_step(run) -> dict:
    return {m["step"]: m for m in read_jsonl(run / "metrics.jsonl")}


def fake_rollout(step: int, generated=None) -> StepRollout:
    return StepRollout(step, [], 0.0, (0.0, 0.0), {"epoch": 0, "cursor": 0})


def test_a_stuck_rollout_side_times_out_naming_the_step():
    release = threading.Event()

    def stuck(step: int, generated) -> StepRollout:
        release.wait(30)
        return fake_rollout(step)

    prefetch = RolloutPrefetcher(stuck, timeout_s=0.3)
    prefetch.start(7)
    start = time.monotonic()
    with pytest.raises(RolloutTimeout, match="rollout side to finish step 7's rollout") as e:
        prefetch.drain()
    assert time.monotonic() - start < 5 and "rollout.async_timeout_s" in str(e.value)
    # Still in flight after the timeout: a failed run's close must not close the worker it runs on, and its
    # thread is a daemon, so the process does not wait for it on the way out.
    assert prefetch.in_flight and not prefetch.close(wait_s=0.0)
    assert [t.daemon for t in threading.enumerate() if t.name == "rollout-prefetch"] == [True]
    release.set()
    assert prefetch.close() and not prefetch.in_flight


def test_a_push_waits_for_the_generation_not_for_the_rewards():
    """`wait_generated` (before a weight push) returns once the rollout no longer uses the engine, while
    its rewards are still computing; `take` waits for them. A rollout that never says so counts as
    generated when it returns; one stuck generating times out naming the step."""
    scoring = threading.Event()

    def slow_judge(step: int, generated) -> StepRollout:
        generated()
        scoring.wait(30)
        return fake_rollout(step)

    prefetch = RolloutPrefetcher(slow_judge, timeout_s=5)
    prefetch.start(2)
    assert prefetch.wait_generated() < 4 and prefetch.in_flight
    scoring.set()
    assert prefetch.take(2).step == 2 and not prefetch.in_flight
    prefetch.close()

    silent = RolloutPrefetcher(fake_rollout, timeout_s=5)
    silent.start(3)
    silent.wait_generated()
    assert silent.take(3).step == 3
    silent.close()

    release = threading.Event()
    stuck = RolloutPrefetcher(lambda step, generated: release.wait(30) and fake_rollout(step), timeout_s=0.3)
    stuck.start(4)
    with pytest.raises(RolloutTimeout, match="finish generating step 4's rollout"):
        stuck.wait_generated()
    release.set()
    stuck.close()


def test_a_failed_rollout_stops_the_push_with_its_own_error():
    """A rollout that fails before it finishes generating (a lost rollout rank, a broken engine) ends the
    wait before the weight push with that error: the push must not go ahead as if it had generated."""
    class LostRolloutRank(RuntimeError):
        pass

    def broken(step: int, generated) -> StepRollout:
        raise LostRolloutRank(f"rollout rank 1 stopped answering during step {step}'s rollout")

    prefetch = RolloutPrefetcher(broken, timeout_s=5)
    prefetch.start(3)
    with pytest.raises(LostRolloutRank, match="step 3's rollout"):
        prefetch.wait_generated()
    prefetch.close()


def test_the_worker_says_generated_before_the_rewards_are_in(tmp_path, stub_tokenizer):
    """RolloutWorker.rollout calls on_generated once, after every sample's last engine call and before
    a slow (async) reward_fn has finished any sample: the push may overlap the scoring."""
    import asyncio

    from train.engines.base import Generation, SamplingParams
    from train.workers.environment import Environment
    from train.workers.rollout import RolloutWorker

    class OneTokenEngine:
        weight_version = 0

        async def generate(self, prompt_ids, sampling):
            await asyncio.sleep(0.01)
            return Generation([stub_tokenizer.eos_token_id], [-0.5], "stop")

        def close(self):
            pass

    env_file = tmp_path / "slow_judge.py"
    env_file.write_text("import asyncio\nEVENTS = []\n\nasync def reward_fn(messages, answer):\n"
                        "    await asyncio.sleep(0.3)\n    EVENTS.append('reward')\n    return 1.0\n")
    env = Environment(str(env_file), timeout_s=30, max_workers=2, max_turns=1)
    worker = RolloutWorker(OneTokenEngine(), env, stub_tokenizer, max_turns=1, env_error_reward=0.0,
                           max_total_length=64)
    events = env.module.EVENTS
    rows = [{"messages": [{"role": "user", "content": f"{i} + 1 ="}], "answer": "x"} for i in range(3)]
    samples, _ = worker.rollout(rows, 2, SamplingParams(max_new_tokens=4), 0,
                                on_generated=lambda: events.append("generated"))
    assert events == ["generated"] + ["reward"] * 6 and [s.reward for s in samples] == [1.0] * 6
    worker.close()


def test_the_prefetcher_hands_over_each_step_once_in_order():
    prefetch = RolloutPrefetcher(fake_rollout, timeout_s=10)
    assert prefetch.take(1) is None  # nothing prepared: the trainer rolls out itself
    prefetch.start(2)
    with pytest.raises(RuntimeError, match="while step 2's is in flight"):
        prefetch.start(3)
    assert [r.step for r in prefetch.pending()] == [2]  # what a checkpoint keeps (drained)
    prefetch.start(3)  # several finished rollouts queue up (rollout.max_staleness > 1)
    assert prefetch.queued() == [2, 3]
    with pytest.raises(RuntimeError, match="step 2's, step 3 asked"):
        prefetch.take(3)
    assert prefetch.take(2).step == 2 and prefetch.take(3).step == 3 and prefetch.take(4) is None
    prefetch.restore([fake_rollout(4), fake_rollout(5)])
    with pytest.raises(RuntimeError, match="started after step 5's"):
        prefetch.start(7)
    assert prefetch.take(4).step == 4 and prefetch.take(5).step == 5 and prefetch.take(6) is None
    assert staleness([[3, 4], [4], []], 4) == [1, 0, 0]
    prefetch.close()


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, small_data):
    """6 one-step-off steps on 2 ranks over 2.4 epochs, checkpoints at 3 and 6."""
    return run_async(tmp_path_factory.mktemp("async"), small_data, 6, "trainer.save_freq=3", nproc=2)


def test_samples_are_one_version_old_and_importance_weighted(async_run):
    metrics = metrics_by_step(async_run)
    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    # Step 1 is rolled out with the start weights; every later step's rollout ran during the step
    # before and used that step's starting weights: exactly one version old, never more.
    assert metrics[1]["async/staleness_max"] == 0.0
    for step in range(2, 7):
        assert metrics[step]["async/staleness_max"] == metrics[step]["async/staleness_mean"] == 1.0
        # The trainer's log-probs (current weights) against the sampler's (stale): a real mismatch,
        # which the truncated IS weights (actor.tis_cap defaults to 2.0 here) correct.
        assert metrics[step]["actor/sampler_kl"] > 1e-5
        assert "actor/tis_clipped" in metrics[step]
    samples = [e for e in read_jsonl(async_run / "trajectories.jsonl") if e["type"] == "sample"]
    assert samples and all(s["turn_versions"] == [max(s["step"] - 2, 0)] * s["n_turns"] for s in samples)
    assert "tis_cap: 2.0" in (async_run / "config.yaml").read_text()


def test_async_resume_is_exact_across_an_epoch_boundary(async_run, small_data, tmp_path):
    """3 steps + resume + 3 steps == 6 steps straight (weights and Adam moments bit for bit): the
    checkpoint holds step 4's finished rollout; no prompt is repeated or lost across epochs 1-2."""
    resumed = run_async(tmp_path / "resumed", small_data, 6, "trainer.save_freq=3",
                        f"trainer.load_ckpt_from={async_run / 'step3'}", nproc=2)
    a, b = consolidate(str(async_run / "step6")), consolidate(str(resumed / "step6"))
    assert_same(a, b)
    assert any("exp_avg_sq" in k for k in _flatten(a["actor"]["optimizer"]))
    straight, again = prompts_by_step(async_run), prompts_by_step(resumed)
    assert sorted(again) == [4, 5, 6] and all(again[s] == straight[s] for s in (4, 5, 6))
    # 10 prompts, 4 per step: steps 1-5 draw exactly 2 epochs, so each prompt twice (x 4 responses)
    counts = Counter(p for step in range(1, 6) for p in straight[step])
    assert len(counts) == 10 and set(counts.values()) == {8}


@pytest.mark.slow
def test_extending_a_finished_run_trains_its_first_new_step_on_policy(async_run, small_data, tmp_path):
    """docs/training.md ("Extending a finished run"): the last step rolls nothing ahead, so the final
    checkpoint holds no pending rollout and the first new step is rolled out after the resume, with
    the final weights (staleness 0); the pipeline then fills again."""
    import shutil

    import torch

    state = torch.load(async_run / "step6" / "trainer_state.pt", weights_only=False)
    assert "pending_rollout" not in state
    extended = tmp_path / "extended"
    shutil.copytree(async_run, extended)  # (the module's run stays as it is for the other tests)
    run_async(extended, small_data, 7, "trainer.save_freq=3", "trainer.load_ckpt_from=latest", nproc=2)
    assert metrics_by_step(extended)[7]["async/staleness_max"] == 0.0


@pytest.mark.slow
def test_async_resume_on_another_world_size_rolls_the_pending_prompts_out_again(async_run, small_data, tmp_path):
    """The pending rollout belongs to the saving ranks; on 1 rank its prompts are drawn again (no
    prompt lost or repeated), with the resumed weights."""
    resumed = run_async(tmp_path / "one_rank", small_data, 5, f"trainer.load_ckpt_from={async_run / 'step3'}")
    assert_redrawn(async_run, resumed)
    assert metrics_by_step(resumed)[4]["async/staleness_max"] == 0.0  # rolled out again with the resumed weights


def assert_redrawn(straight_run, resumed) -> None:
    """The resumed run (steps 4 and 5 after the step-3 checkpoint) trained on the prompts the straight
    run trained on at those steps: none lost or repeated."""
    straight, again = prompts_by_step(straight_run), prompts_by_step(resumed)
    assert sorted(again) == [4, 5] and again[4] == straight[4] and again[5] == straight[5]


@pytest.fixture(scope="module")
def two_off_run(tmp_path_factory, small_data):
    """6 steps at staleness 2 on 1 rank over 2.4 epochs, checkpoints at 3 and 6."""
    return run_async(tmp_path_factory.mktemp("async2"), small_data, 6, "trainer.save_freq=3", "rollout.max_staleness=2")


def test_staleness_two_samples_are_two_versions_old(two_off_run):
    """Step M's rollout ran during step M-2 with the weights of step M-3: steps 1 and 2 are rolled
    out with the start weights (0 and 1 version old), every later step exactly 2 versions old."""
    metrics = metrics_by_step(two_off_run)
    assert [metrics[s]["async/staleness_max"] for s in range(1, 7)] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    samples = [e for e in read_jsonl(two_off_run / "trajectories.jsonl") if e["type"] == "sample"]
    assert samples and all(s["turn_versions"] == [max(s["step"] - 3, 0)] * s["n_turns"] for s in samples)
    assert all("actor/tis_clipped" in metrics[s] for s in range(1, 7))


def test_staleness_two_resume_is_exact_and_keeps_both_pending_rollouts(two_off_run, small_data, tmp_path):
    """The step-3 checkpoint holds the finished rollouts of steps 4 and 5; 3 + resume + 3 steps give
    the weights of 6 straight bit for bit, with the same prompts at every step (across epochs)."""
    import torch

    state = torch.load(two_off_run / "step3" / "trainer_state.pt", weights_only=False)
    assert state["pending_rollout"]["steps"] == [4, 5] and state["pending_rollout"]["max_staleness"] == 2
    resumed = run_async(tmp_path / "resumed2", small_data, 6, "trainer.save_freq=3",
                        f"trainer.load_ckpt_from={two_off_run / 'step3'}", "rollout.max_staleness=2")
    assert_same(consolidate(str(two_off_run / "step6")), consolidate(str(resumed / "step6")))
    straight, again = prompts_by_step(two_off_run), prompts_by_step(resumed)
    assert sorted(again) == [4, 5, 6] and all(again[s] == straight[s] for s in (4, 5, 6))
    metrics = metrics_by_step(resumed)
    assert [metrics[s]["async/staleness_max"] for s in (4, 5, 6)] == [2.0, 2.0, 2.0]  # trained as generated


@pytest.mark.slow
def test_a_resume_at_another_staleness_rolls_the_pending_prompts_out_again(two_off_run, small_data, tmp_path):
    """Rollouts queued at staleness 2 would be too old for a staleness-1 run: their prompts are drawn
    again with the resumed weights; none is lost or repeated."""
    resumed = run_async(tmp_path / "one_off", small_data, 5, f"trainer.load_ckpt_from={two_off_run / 'step3'}")
    assert_redrawn(two_off_run, resumed)
    metrics = metrics_by_step(resumed)
    assert metrics[4]["async/staleness_max"] == 0.0 and metrics[5]["async/staleness_max"] == 1.0


def test_bad_staleness_is_refused():
    from conftest import compose_config
    from train.trainer.config import ConfigError, validate

    for bad in ("-1", "1.5", "true"):
        with pytest.raises(ConfigError, match="rollout.max_staleness.*integer >= 0"):
            validate(compose_config([f"rollout.max_staleness={bad}"]))
    validate(compose_config(["rollout.max_staleness=3"]))
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        validate(compose_config(["rollout.max_staleness=2", "rollout.dynamic_sampling=true"]))


def test_pending_rollouts_of_an_older_checkpoint_keep_their_shaped_rewards():
    """A checkpoint written before samples carried their shaped reward held it in parallel lists on the
    rollout: a resume moves it onto the samples (else they would train on no reward at all)."""
    from train.trainer.rollouts import with_rewards_on_samples
    from train.workers.rollout import Sample

    samples = [Sample(0, [], None, [1, 2], [0, 1], [0.0, -0.5], reward=r) for r in (1.0, 0.0)]
    old = StepRollout(3, samples, 0.0, (0.0, 0.0), {"epoch": 0, "cursor": 0})
    old.__dict__.update(rewards=[0.75, -0.25], penalties=[-0.25, -0.25])  # as unpickled from the old layout
    restored, = with_rewards_on_samples([old])
    assert [(s.shaped_reward, s.overlong_penalty) for s in restored.samples] == [(0.75, -0.25), (-0.25, -0.25)]
    assert "rewards" not in vars(restored) and "penalties" not in vars(restored)


STUCK_AFTER_FIRST_STEP = """
import asyncio

calls = 0


async def reward_fn(messages, answer):
    global calls
    calls += 1
    if calls > 16:  # step 1's 16 samples are scored; the prefetched step 2's judge never answers in time
        await asyncio.sleep(300)
    return 1.0
"""


def test_a_prefetched_rollout_stuck_in_its_judge_fails_the_run_at_once_with_its_line(small_data, tmp_path):
    """Step 2's rollout, made ahead on the rollout thread, hangs in its judge: the trainer waits
    rollout.async_timeout_s for it, then ends with one error line naming the step and the key, and the process
    exits without waiting for the judge (it used to close the worker under the running rollout, print that
    error instead, and wait for the thread at exit)."""
    env_file = tmp_path / "stuck_judge.py"
    env_file.write_text(STUCK_AFTER_FIRST_STEP)
    start = time.monotonic()
    out = run_trainer([f"trainer.save_dir={tmp_path / 'run'}", f"data.train_data_path={small_data}",
                       "trainer.total_steps=3", *ASYNC, f"rollout.env_path={env_file}", "rollout.async_timeout_s=3",
                       "rollout.env_timeout_s=300"], check=False, timeout=150)
    assert out.returncode == 4, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout.async_timeout_s" in errors[0] and "step 2's rollout" in errors[0], errors
    assert "event loop is already running" not in out.stderr
    assert time.monotonic() - start < 60  # start-up, one step and 3 s of waiting; not the judge's 300 s
