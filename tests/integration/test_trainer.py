"""End-to-end runs of `torchrun -m train.trainer.grpo` on the bundled stub model."""
import json
import math
import textwrap

import pytest
import torch

from conftest import ROOT, STUB_MATH, read_jsonl, run_trainer, slow
from train.runtime.checkpoint import consolidate

SMALL = ["data.prompts_per_rollout=4", "data.responses_per_prompt=4", "rollout.dynamic_filtering=false",
         "trainer.test_freq=null", "trainer.log_samples=100"]


def prompts_by_step(run_dir) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for e in read_jsonl(run_dir / "trajectories.jsonl"):
        if e["type"] == "sample":
            out.setdefault(e["step"], []).append(e["messages"][0]["content"])
    return {k: sorted(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """4 steps on 2 ranks, checkpoints at 2 and 4."""
    run = tmp_path_factory.mktemp("straight")
    run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=4", "trainer.save_freq=2", *SMALL], nproc=2)
    return run


def test_run_leaves_the_documented_files(straight_run):
    run = straight_run
    assert (run / "config.yaml").exists()
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in ["rewards/train", "response_length/train", "length_clip_ratio/train", "n_turns/train",
                "dynamic_filtering_ratio", "actor/loss", "actor/grad_norm", "actor/entropy", "env/errors",
                "time/rollout_s", "time/update_s", "time/weight_sync_s", "time/step_s"]:
        assert all(key in m and math.isfinite(m[key]) for m in metrics), key
    # The hf engine and the trainer agree on log-probs to float rounding.
    assert all(m["actor/sampler_abs_diff"] < 1e-4 for m in metrics)
    assert all(abs(m["actor/sampler_kl"]) < 1e-8 and m["actor/sampler_ratio_max"] < 1 + 1e-4 for m in metrics)
    kinds = {e["type"] for e in read_jsonl(run / "trajectories.jsonl")}
    assert {"sample", "checkpoint"} <= kinds
    for step in (2, 4):
        assert (run / f"step{step}" / "COMPLETE").exists()
    assert not list(run.glob("*.tmp"))
    # sharded: each of the 2 ranks wrote its own shard file, rank 0 the metadata
    assert sorted(p.name for p in (run / "step4" / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "latest")
    tok = AutoTokenizer.from_pretrained(run / "latest")
    saved = consolidate(str(run / "step4"))["actor"]["model"]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
    assert tok.eos_token == "<|im_end|>"


def test_resume_is_exact(straight_run, tmp_path):
    """2 steps + resume + 2 steps == 4 steps straight: weights, Adam moments, data order."""
    resumed = tmp_path / "resumed"
    run_trainer([f"trainer.save_dir={resumed}", "trainer.total_steps=4", "trainer.save_freq=2",
                 f"trainer.load_ckpt_from={straight_run / 'step2'}", *SMALL], nproc=2)
    a, b = consolidate(str(straight_run / "step4")), consolidate(str(resumed / "step4"))
    assert_same(a, b)
    assert any("exp_avg_sq" in k for k in _flatten(a["actor"]["optimizer"]))
    straight, again = prompts_by_step(straight_run), prompts_by_step(resumed)
    assert sorted(again) == [3, 4]
    assert again[3] == straight[3] and again[4] == straight[4]  # no repeated or skipped prompts
    assert not set(again[3]) & set(straight[1] + straight[2])


@pytest.mark.slow
def test_resume_is_exact_under_tensor_parallel(tmp_path):
    """tp=2: 4 steps straight == 2 + resume + 2, bit for bit. (A checkpoint moving between layouts
    and world sizes: tests/integration/test_checkpoints.py.)"""
    tp = ["actor.tp_size=2", *SMALL]
    straight, resumed = tmp_path / "tp_straight", tmp_path / "tp_resumed"
    run_trainer([f"trainer.save_dir={straight}", "trainer.total_steps=4", "trainer.save_freq=2", *tp], nproc=2)
    run_trainer([f"trainer.save_dir={resumed}", "trainer.total_steps=4", "trainer.save_freq=2",
                 f"trainer.load_ckpt_from={straight / 'step2'}", *tp], nproc=2)
    assert_same(consolidate(str(straight / "step4")), consolidate(str(resumed / "step4")))


def assert_same(a: dict, b: dict) -> None:
    """Two consolidated checkpoints hold bit-identical models, optimizers (Adam moments), schedulers
    and trainer state (step, dataloader position, ...)."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        if isinstance(flat_a[key], torch.Tensor):
            assert torch.equal(flat_a[key], flat_b[key]), key
        else:
            assert flat_a[key] == flat_b[key], key


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}/"))
        return out
    return {prefix: obj}


def test_latest_resumes_and_atomic_checkpoints(tmp_path):
    from train.runtime.checkpoint import find_latest

    (tmp_path / "step6.tmp").mkdir()  # a crash mid-save leaves only a .tmp folder
    (tmp_path / "step5").mkdir()  # no COMPLETE marker: ignored
    (tmp_path / "step4").mkdir()
    (tmp_path / "step4" / "COMPLETE").touch()
    assert find_latest(str(tmp_path)) == str(tmp_path / "step4")
    assert find_latest(str(tmp_path / "missing")) is None


def test_edge_cases_fewer_rows_than_ranks_one_response(tmp_path):
    """1 row on 2 ranks, one response per prompt with std normalisation: no crash, no NaN."""
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "12 + 30"}], "answer": "42"}) + "\n")
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", f"data.train_data_path={data}", "data.prompts_per_rollout=2",
                 "data.responses_per_prompt=1", "adv.norm_var=true", "rollout.dynamic_filtering=false",
                 "trainer.total_steps=2", "trainer.test_freq=null"], nproc=2)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert len(metrics) == 2
    assert all(math.isfinite(m["actor/loss"]) and m["actor/loss"] == 0.0 for m in metrics)


def test_all_groups_filtered_skips_the_update_on_every_rank(tmp_path):
    env = tmp_path / "const.py"
    env.write_text("def reward_fn(messages, answer):\n    return 1.0\n")
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", f"rollout.env_path={env}", "data.prompts_per_rollout=4",
                 "trainer.total_steps=2", "trainer.test_freq=null"], nproc=2)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["actor/skipped"] for m in metrics] == [1.0, 1.0]
    assert all(m["dynamic_filtering_ratio"] == 1.0 for m in metrics)


RUBRIC_ENV = """
import sys
sys.path.insert(0, {env_dir!r})
from eq import extract_answer, normalize
from train.workers.rubric import Criterion, Rubric, regex

def correct(messages, answer, state):
    return float(normalize(extract_answer(messages[-1]["content"])) == normalize(answer))

def flaky(messages, answer, state):
    if len(messages[-1]["content"]) % 2:
        raise ConnectionError("judge down")
    return 1.0

RUBRIC = Rubric([regex("format", r"<answer>.*?</answer>", weight=1.0), Criterion("correct", correct, weight=3.0),
                 Criterion("judge", flaky, weight=0.0)])
reward_fn = RUBRIC.reward_fn
"""


def test_a_rubric_reward_logs_each_criterion_and_a_failing_one_costs_only_itself(tmp_path):
    """Two ranks, a rubric env: rubric/<name> per step; the reward is the weighted mean of the criteria (so its
    batch mean is too); a criterion that raises on half the replies scores 0 there and the run goes on."""
    env = tmp_path / "rubric_env.py"
    env.write_text(RUBRIC_ENV.format(env_dir=str(ROOT / "environments")))
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", f"rollout.env_path={env}", "trainer.total_steps=2", *SMALL], nproc=2)
    metrics = read_jsonl(run / "metrics.jsonl")
    for m in metrics:
        assert m["env/errors"] == 0
        assert m["rewards/train"] == pytest.approx((m["rubric/format"] + 3 * m["rubric/correct"]) / 4)
        assert 0.0 <= m["rubric/judge"] < 1.0
    rows = [r for r in read_jsonl(run / "trajectories.jsonl") if "criteria" in r]
    assert rows and all(set(r["criteria"]) == {"format", "correct", "judge"} for r in rows)
    failed = [ev for r in rows for ev in r["events"] if ev["type"] == "rubric_error"]
    assert all(ev == {"type": "rubric_error", "criterion": "judge", "error": "ConnectionError: judge down"}
               for ev in failed)
    assert bool(failed) == any(r["criteria"]["judge"] == 0.0 for r in rows)


MULTI_TURN_ENV = """
import time

def interact(messages):
    if sum(m["role"] == "assistant" for m in messages) == 1:
        return [{"role": "tool", "content": "tool says: check the tens digit"}]
    return []

def reward_fn(messages, answer):
    reply = messages[-1]["content"]
    digits = sum(c.isdigit() for c in reply)
    if digits % 3 == 0:
        raise ValueError("reward service exploded")
    if digits % 3 == 1:
        time.sleep(60)  # hangs: the 1 s env timeout scores it
    return 1.0 if answer in reply else 0.5
"""


def test_multi_turn_env_errors_and_kl(tmp_path):
    """Tool turns are templated in and masked; raising and hanging reward_fn calls are scored with
    rollout.env_error_reward, logged and counted, and the run goes on (with a KL reference)."""
    env = tmp_path / "tool_env.py"
    env.write_text(textwrap.dedent(MULTI_TURN_ENV))
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", f"rollout.env_path={env}", "rollout.max_turns=2",
                 "rollout.env_timeout_s=1", "rollout.env_error_reward=-1", "data.prompts_per_rollout=4",
                 "trainer.total_steps=2", "trainer.test_freq=null", "trainer.log_samples=100",
                 "actor.kl.coef=0.01", "actor.kl.type=k3"], nproc=1, timeout=300)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert sum(m["env/errors"] for m in metrics) > 0
    assert all(m["n_turns/train"] > 1 for m in metrics)
    events = read_jsonl(run / "trajectories.jsonl")
    errors = [e for e in events if e["type"] == "env_error"]
    assert any("exploded" in e["error"] for e in errors)
    assert any("timeout" in e["error"] for e in errors)
    samples = [e for e in events if e["type"] == "sample"]
    assert any(e["reward"] == -1 for e in samples)
    tool_turns = [e for e in samples if any(m["role"] == "tool" for m in e["messages"])]
    assert tool_turns and all(e["events"][0]["type"] == "tool" for e in tool_turns)
    assert any("actor/kl" in m and math.isfinite(m["actor/kl"]) for m in metrics)


@pytest.mark.slow
def test_evaluation_before_and_after(tmp_path):
    run = tmp_path / "run"
    proc = run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=2", "trainer.test_freq=1",
                        f"data.test_data_path={STUB_MATH / 'test.jsonl'}", "data.prompts_per_rollout=4"], nproc=1)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics if "rewards/test" in m] == [0, 1, 2]
    assert "test reward:" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------
# the algorithm set (issue 7): PPO + critic, target KL, DAPO, governor


@pytest.mark.slow
def test_ppo_with_critic_metrics_and_exact_resume(tmp_path):
    """PPO (GAE + critic) on 2 ranks: the documented metrics, and 2 + resume + 2 steps == 4 steps for
    the actor, the critic, both optimizers and schedulers, and the running reward statistics."""
    args = ["algorithm=ppo", "trainer.total_steps=4", "trainer.save_freq=2", *SMALL]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer([f"trainer.save_dir={straight}", *args], nproc=2)
    run_trainer([f"trainer.save_dir={resumed}", f"trainer.load_ckpt_from={straight / 'step2'}", *args], nproc=2)
    metrics = read_jsonl(straight / "metrics.jsonl")
    for key in ["critic/value_loss", "critic/explained_variance", "critic/grad_norm", "critic/clip_fraction",
                "critic/reward_scale", "actor/approx_kl", "actor/clip_fraction", "actor/ratio_max", "actor/ratio_min",
                "actor/epochs", "actor/early_stopped", "actor/entropy_coef"]:
        assert all(key in m and math.isfinite(m[key]) for m in metrics), key
    assert all(m["actor/optimizer_steps"] >= 1 for m in metrics)
    a, b = consolidate(str(straight / "step4")), consolidate(str(resumed / "step4"))
    assert_same(a, b)  # actor, critic, both optimizers and schedulers, the running reward statistics
    critic_sd = a["critic"]["model"]
    assert "value_head.weight" in critic_sd and float(critic_sd["value_head.weight"].abs().max()) > 0
    assert a["trainer_state"]["reward_moments"]["count"] == 4 * 16


def test_target_kl_stops_the_epochs_early(tmp_path):
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=2", "actor.update_per_rollout=6",
                 "actor.target_kl=1e-4", "actor.lr=1e-3", "actor.tis_cap=2.0", "actor.tis_level=sequence",
                 *SMALL], nproc=1)
    metrics = read_jsonl(run / "metrics.jsonl")
    stopped = [m for m in metrics if m["actor/early_stopped"] == 1.0]
    assert stopped, metrics
    for m in stopped:  # stopped in epoch e: fewer optimizer steps than the 6 planned
        assert 1 <= m["actor/stop_epoch"] <= 6 and m["actor/epochs"] == m["actor/stop_epoch"]
        assert m["actor/optimizer_steps"] < 6 and m["actor/optimizer_steps"] == m["actor/stop_epoch"] - 1


@pytest.mark.slow  # suite time: CISPO's and masked IS's math against references in tests/unit/test_algorithms.py
def test_cispo_with_masked_importance_sampling_trains(tmp_path):
    """The CISPO preset (two passes per rollout: the IS weight acts on the second) with token-level masked
    IS and TIS on: the step runs the registered loss, and the masked share is reported."""
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=2", "algorithm=cispo", "actor.lr=1e-3",
                 "actor.mis_level=token", "actor.mis_low=0.5", "actor.mis_high=2.0", "actor.tis_cap=2.0",
                 *SMALL], nproc=1)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert "loss: cispo" in (run / "config.yaml").read_text()
    for m in metrics:
        assert 0.0 <= m["actor/mis_masked"] <= 1.0 and 0.0 <= m["actor/clip_fraction"] <= 1.0
        assert m["actor/optimizer_steps"] == 2 and math.isfinite(m["actor/loss"])
    assert any(m["actor/ratio_max"] != 1.0 for m in metrics)  # the second pass saw moved weights


@pytest.mark.parametrize("loss,extra", [slow("sapo", ["actor.agg_mode=seq_mean_token_mean"]),
                                        slow("dppo_tv", []), slow("dppo_kl", []), slow("dro", ["actor.dro_beta=0.1"]),
                                        slow("clip_cov", ["actor.cov_ratio=0.05"]), slow("kl_cov", ["actor.cov_ratio=0.05"])])
def test_each_registered_loss_trains_through_the_actor(tmp_path, loss, extra):
    """The losses verl 0.9.1 also registers, picked by actor.loss and set from actor.* (the actor's loss_settings),
    over two passes per rollout so that the second pass sees moved weights."""
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=2", f"actor.loss={loss}", "actor.lr=1e-3",
                 "actor.update_per_rollout=2", *extra, *SMALL], nproc=1)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert f"loss: {loss}" in (run / "config.yaml").read_text()
    for m in metrics:
        assert m["actor/optimizer_steps"] == 2 and math.isfinite(m["actor/loss"])
        assert 0.0 <= m["actor/clip_fraction"] <= 1.0 and math.isfinite(m["actor/grad_norm"])
    assert any(m["actor/ratio_max"] != 1.0 for m in metrics)


def test_a_student_distilled_from_itself_sees_no_reverse_kl(tmp_path):
    """algorithm=distill with the actor's own model as the teacher: the teacher (in the reference slot) scores
    the very tokens the student sampled, at the same positions, so before any update the per-token reverse KL
    is at float rounding; a teacher misaligned by one token would show ~1 nat."""
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=1", "algorithm=distill",
                 "distill.teacher=stub/model", *SMALL], nproc=1)
    (m,) = read_jsonl(run / "metrics.jsonl")
    assert abs(m["distill/reverse_kl"]) < 1e-4, m["distill/reverse_kl"]
    assert m["actor/optimizer_steps"] >= 1 and math.isfinite(m["actor/loss"])
    assert "teacher: stub/model" in (run / "config.yaml").read_text()


def test_teachers_by_data_source_score_only_their_sources_samples(tmp_path):
    """distill.teachers on 2 ranks: a two-source mixture (the same math rows under two names) where only `math`
    has a teacher, a copy of the student with moved weights. Its samples carry a clear reverse KL, the other
    source's none (its share of the tokens is untaught), and the task reward still trains both."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = tmp_path / "teacher"
    model = AutoModelForCausalLM.from_pretrained(ROOT / "stub" / "model")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    model.save_pretrained(teacher)
    AutoTokenizer.from_pretrained(ROOT / "stub" / "model").save_pretrained(teacher)
    math_rows = "stub/data/math/train.jsonl"
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=2",
                 f"data.train_data_path={{math: {math_rows}, again: {math_rows}}}",
                 "rollout.env_path={math: environments/eq.py, again: environments/eq.py}",
                 f"distill.teachers={{math: {teacher}}}", *SMALL], nproc=2)
    metrics = read_jsonl(run / "metrics.jsonl")
    shares = [m["distill/taught_share"] for m in metrics]
    assert all(0.0 <= s <= 1.0 for s in shares) and 0.0 < sum(shares) / len(shares) < 1.0, shares
    assert all(m["distill/reverse_kl"] > 0.01 for m in metrics if m["distill/taught_share"] > 0), metrics


HALF_INFORMATIVE_ENV = """
def reward_fn(messages, answer):
    if int(answer) % 2:  # odd answers: every response scores the same, the group carries no signal
        return 1.0
    return float(sum(map(ord, messages[-1]["content"])) % 2)
"""


def test_dapo_dynamic_sampling_refills_to_a_full_batch(tmp_path):
    """About half the groups are uninformative: refills bring every step to prompts_per_rollout
    informative groups, on 2 ranks that must agree on every round."""
    env = tmp_path / "half.py"
    env.write_text(textwrap.dedent(HALF_INFORMATIVE_ENV))
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", f"rollout.env_path={env}", "algorithm=dapo", "trainer.total_steps=3",
                 "rollout.dynamic_sampling_max_rounds=8", "data.prompts_per_rollout=4", "data.responses_per_prompt=4",
                 "trainer.test_freq=null"], nproc=2)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert all(m["batch/groups"] == 4 and m["dynamic_sampling/groups"] == 4 for m in metrics)
    assert max(m["dynamic_sampling/rounds"] for m in metrics) >= 2  # refills happened
    assert all(m["dynamic_filtering_ratio"] > 0 for m in metrics)


@pytest.mark.slow
def test_dapo_dynamic_sampling_is_bounded_and_logged(tmp_path):
    env = tmp_path / "const.py"
    env.write_text("def reward_fn(messages, answer):\n    return 1.0\n")
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", f"rollout.env_path={env}", "rollout.dynamic_sampling=true",
                 "rollout.dynamic_sampling_max_rounds=3", "data.prompts_per_rollout=4", "data.responses_per_prompt=2",
                 "trainer.total_steps=1", "trainer.test_freq=null"], nproc=2)
    (m,) = read_jsonl(run / "metrics.jsonl")
    assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/groups"] == 0 and m["actor/skipped"] == 1.0
    events = [e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "dynamic_sampling.short"]
    assert events and events[0]["rounds"] == 3 and events[0]["target"] == 4


def test_overlong_shaping_turns_length_into_signal(tmp_path):
    """A constant reward gives no signal (every step would be skipped, see above); the soft overlong
    penalty over the whole 12-token budget makes longer responses score lower, so groups are kept."""
    env = tmp_path / "const.py"
    env.write_text("def reward_fn(messages, answer):\n    return 1.0\n")
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", f"rollout.env_path={env}", "rollout.overlong_buffer=12",
                 "rollout.overlong_penalty=0.5", "data.prompts_per_rollout=8", "trainer.total_steps=2",
                 "trainer.test_freq=null"], nproc=1)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert sum(m["batch/groups"] for m in metrics) > 0 and any("actor/loss" in m for m in metrics)
    assert all(-0.5 <= m["rewards/overlong_penalty"] < 0 and m["rewards/train"] == 1.0 for m in metrics)


GOVERNOR_ENV = """
import itertools, threading

_calls, _lock = itertools.count(), threading.Lock()
PER_STEP = 16  # 4 prompts x 4 responses, one process

def reward_fn(messages, answer):
    with _lock:
        step = next(_calls) // PER_STEP + 1
    r = (sum(map(ord, messages[-1]["content"])) % 3) / 2
    if step == 5:
        return 1e39  # (NaN and inf are env errors) finite here, inf in float32: NaN losses and gradients
    if step == 8:
        return 1e4 * r  # a loss / grad-norm spike
    return r
"""


def test_governor_rolls_back_nan_and_spike_and_the_engine_never_sees_them(tmp_path):
    """PPO with a critic: at step 5 a reward beyond float32's range makes the losses and gradients NaN; at step 8 rewards
    x 1e4 make the critic's value loss spike. Both updates are rolled back (actor, critic, optimizers),
    their batches skipped, `governor.rollback` events logged, and the engine only ever received the
    weights of accepted steps."""
    env = tmp_path / "bad.py"
    env.write_text(textwrap.dedent(GOVERNOR_ENV))
    run = tmp_path / "run"
    run_trainer([f"trainer.save_dir={run}", f"rollout.env_path={env}", "trainer.total_steps=10", "algorithm=ppo",
                 "actor.update_per_rollout=1", "critic.update_per_rollout=1", "critic.reward_norm=false",
                 "trainer.governor.enable=true", "trainer.governor.min_history=3", "trainer.governor.k_sigma=10",
                 *SMALL], nproc=1)
    metrics = {m["step"]: m for m in read_jsonl(run / "metrics.jsonl")}
    rolled = [s for s, m in metrics.items() if m["governor/rollback"] == 1.0]
    assert rolled == [5, 8]
    for s in rolled:  # the batch is skipped: nothing pushed to the engine
        assert "time/weight_sync_s" not in metrics[s] and "engine/weights_fingerprint" not in metrics[s]
    pushed = {s: m["engine/weights_fingerprint"] for s, m in metrics.items() if "engine/weights_fingerprint" in m}
    assert sorted(pushed) == [1, 2, 3, 4, 6, 7, 9, 10]
    events = {e["step"]: e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "governor.rollback"}
    assert sorted(events) == [5, 8]
    assert "is nan" in events[5]["reason"] or "is inf" in events[5]["reason"]
    assert "critic/value_loss spike" in events[8]["reason"]
    for s, prev in ((5, 4), (8, 7)):
        e = events[s]
        assert e["restored_fingerprint"] == pushed[prev] == e["engine_fingerprint"]  # back to what the engine has
    # step 8's update did move the actor; the engine never held those weights
    assert events[8]["bad_fingerprint"] != events[8]["restored_fingerprint"]
    assert events[8]["bad_fingerprint"] not in pushed.values()
    # (a non-finite gradient norm skips the optimizer step itself: tests/unit/test_governor.py)
    # after a rollback training goes on from the restored weights, with sane losses
    assert pushed[6] != pushed[4] and pushed[9] != pushed[7]
    assert metrics[9]["critic/value_loss"] < 100 * metrics[7]["critic/value_loss"] + 1
