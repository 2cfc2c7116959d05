"""In-flight rollouts (rollout.inflight, issue 41): sequences that keep generating across weight updates, each
token with the version that sampled it, the per-sample staleness bound (requeue | finish) that drops no prompt,
and checkpoints that keep every group in flight: an exact resume, and no group lost or trained twice on another
world size."""
import time
from collections import Counter

import pytest
import torch

from conftest import ROOT, compose_config, read_jsonl, run_trainer
from test_trainer import assert_same
from train.runtime.checkpoint import consolidate

INFLIGHT = ["rollout.inflight=true", "rollout.max_staleness=2", "rollout.segment_tokens=3",
            "rollout.train_sampling_params.max_new_tokens=6", "data.prompts_per_rollout=4",
            "data.responses_per_prompt=4", "rollout.dynamic_filtering=false", "trainer.test_freq=null",
            "trainer.log_samples=100"]

# Three turns: the env asks again twice; the reward is the eq env's on the last answer.
MULTI_TURN_ENV = '''
import importlib.util, os
spec = importlib.util.spec_from_file_location("eq", os.path.join({root!r}, "environments", "eq.py"))
eq = importlib.util.module_from_spec(spec); spec.loader.exec_module(eq)

def interact(messages):
    turns = sum(m["role"] == "assistant" for m in messages)
    return [{{"role": "user", "content": "Are you sure? Answer again."}}] if turns < 3 else []

def reward_fn(messages, answer):
    return eq.reward_fn(messages, answer)
'''


def run_inflight(save, data, steps: int, *overrides: str, nproc: int = 1):
    run_trainer([f"trainer.save_dir={save}", f"data.train_data_path={data}", f"trainer.total_steps={steps}", *INFLIGHT,
                 *overrides], nproc=nproc)
    return save


def trained(run) -> dict[int, list[tuple]]:
    """Per step, every trained sample's (group uid, conversation, versions its tokens came from), in order."""
    out: dict[int, list[tuple]] = {}
    for e in read_jsonl(run / "trajectories.jsonl"):
        if e["type"] == "sample":
            out.setdefault(e["step"], []).append((e["uid"], str(e["messages"]), tuple(e["versions"])))
    return out


def metrics_by_step(run) -> dict:
    return {m["step"]: m for m in read_jsonl(run / "metrics.jsonl")}


def saved_groups(folder, rank: int) -> list:
    return torch.load(folder / f"rank{rank}.pt", weights_only=False)["inflight"]["groups"]


# -- the worker: segments ------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget,defer_env", [(3, False), (100, True)], ids=["3 tokens", "to each env call"])
def test_a_sample_paused_by_segments_samples_what_one_pass_samples(tmp_path, stub_tokenizer, budget, defer_env):
    """Multi-turn samples advanced 3 tokens per segment, or to each env call, which runs on past the segment
    (continuous mode), each
    segment tagged with a new weight version (the weights unchanged), give the same tokens, env turns and rewards
    (collected after the segments) as one uninterrupted rollout, and log-probs equal to
    float32 rounding: a paused turn continues its seeded stream of uniforms, its prefix prefilled again. Every
    sampled token carries the version of its segment; prompt and env tokens carry -1."""
    from train.engines.base import SamplingParams
    from train.engines.hf import HFEngine
    from train.workers.environment import Environment
    from train.workers.rollout import Group, RolloutWorker

    env_file = tmp_path / "three_turns.py"
    env_file.write_text(MULTI_TURN_ENV.format(root=str(ROOT)))
    env = Environment(str(env_file), timeout_s=30, max_workers=2, max_turns=3)
    engine = HFEngine.from_pretrained(str(ROOT / "stub" / "model"), tokenizer=stub_tokenizer)
    worker = RolloutWorker(engine, env, stub_tokenizer, max_turns=3, env_error_reward=0.0, max_total_length=256)
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in ((12, 30), (7, 45), (60, 3))]
    sampling, n, base = SamplingParams(max_new_tokens=10, temperature=1.0), 2, 1234
    straight, _ = worker.rollout(rows, n, sampling, base)

    groups = [Group(g, row, g, [base + (g * n + k) * 7919 for k in range(n)]) for g, row in enumerate(rows)]
    segments = 0
    while not all(g.generated for g in groups):
        engine.weight_version = segments  # a new version each segment (same weights)
        groups, _ = worker.advance(groups, sampling, budget=budget, defer_env=defer_env)
        segments += 1
        if defer_env:  # one env reply per sample per segment at most
            assert all(sum(e["type"] == "tool" for e in p.sample.events) <= segments for g in groups for p in g.members)
    # rewards started when each sample was generated and ran past its segment; `scores` collects them
    keys = [(g.uid, j) for g in groups for j in range(n)]
    got = worker.scores(keys)  # (those already in are on their samples)
    assert set(got) <= set(keys) and all(g.done for g in groups)
    paused = [p.sample for g in groups for p in g.members]
    assert segments >= 3  # 3 turns, and a segment takes up to 3 tokens or one env reply
    for one, other in zip(straight, paused):
        assert one.ids == other.ids and one.action_mask == other.action_mask and one.messages == other.messages
        assert one.reward == other.reward and one.turn_lengths == other.turn_lengths
        assert torch.allclose(torch.tensor(one.sampler_logprobs), torch.tensor(other.sampler_logprobs), atol=1e-4)
        versions = other.token_versions
        assert len(versions) == len(other.ids)
        assert all((v >= 0) == bool(m) for v, m in zip(versions, other.action_mask))
        sampled = [v for v in versions if v >= 0]
        assert sampled == sorted(sampled)  # in order
        if not defer_env:
            assert len(set(sampled)) > 1  # several versions
        else:
            assert len(set(sampled)) == other.n_turns  # each turn in a segment of its own
        assert other.turn_versions == [versions[i] for i in first_token_of_each_turn(other.action_mask)]
    worker.close()


def first_token_of_each_turn(mask: list[int]) -> list[int]:
    return [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]


# -- a run on a dedicated rollout rank ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def split_run(tmp_path_factory, small_data):
    """6 in-flight steps (bound 2, 3-token segments: the stub's answers take 5-6 tokens) on 1 trainer rank + 1
    rollout rank, checkpoints at 3 and 6."""
    return run_inflight(tmp_path_factory.mktemp("inflight"), small_data, 6, "trainer.save_freq=3", "rollout.ranks=1",
                        "trainer.num_threads=1", nproc=2)


def test_tokens_keep_their_versions_within_the_bound(split_run):
    """Trained at step T (the weights of step T-1), every sample's tokens come from versions within 2 of T-1; some
    samples span two versions (their sequence went on across a weight push); the bound needed no requeue."""
    metrics, steps = metrics_by_step(split_run), trained(split_run)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    spanning = 0
    for step, samples in steps.items():
        for _, _, versions in samples:
            assert versions and step - 1 - min(versions) <= 2 and max(versions) <= max(step - 1, 0)
            spanning += len(versions) > 1
        assert metrics[step]["async/staleness_max"] <= 2 and metrics[step]["async/over_stale_share"] == 0
        assert metrics[step]["async/segments"] >= 1
    assert spanning > 0 and max(m["async/version_span_max"] for m in metrics.values()) == 2
    assert all(m["actor/sampler_kl"] > 1e-5 for s, m in metrics.items() if s > 1)  # stale tokens, corrected
    # the KL per version gap: its buckets' token shares add up to 1, their share-weighted KLs to the step's KL
    for step, m in metrics.items():
        shares = {j: m[f"actor/tokens_share_lag{j}"] for j in range(5) if f"actor/tokens_share_lag{j}" in m}
        assert set(shares) <= {0, 1, 2} and sum(shares.values()) == pytest.approx(1.0)
        mixed = sum(share * m[f"actor/sampler_kl_lag{j}"] for j, share in shares.items())
        assert mixed == pytest.approx(m["actor/sampler_kl"], rel=1e-4, abs=1e-9)
    assert any(len([k for k in m if k.startswith("actor/tokens_share_lag")]) == 2 for m in metrics.values())
    # groups trained whole, each once
    uids = [uid for samples in steps.values() for uid, _, _ in samples]
    assert set(Counter(uids).values()) == {4}


def test_a_resume_continues_the_groups_in_flight_exactly(split_run, small_data, tmp_path):
    """Resumed from step 3's checkpoint (which holds the groups in flight, partial samples included), steps 4-6
    train on exactly the samples of the straight run (tokens, versions) and end with its weights bit for bit."""
    in_flight = saved_groups(split_run / "step3", 0)
    assert any(p is not None and not p.done and p.sample.n_action_tokens for g in in_flight for p in g.members or [])
    resumed = run_inflight(tmp_path / "resumed", small_data, 6, "trainer.save_freq=3", "rollout.ranks=1",
                           "trainer.num_threads=1", f"trainer.load_ckpt_from={split_run / 'step3'}", nproc=2)
    straight, again = trained(split_run), trained(resumed)
    assert sorted(again) == [4, 5, 6] and all(again[s] == straight[s] for s in (4, 5, 6))
    assert_same(consolidate(str(split_run / "step6")), consolidate(str(resumed / "step6")))


def test_the_colocated_engine_samples_what_the_rollout_rank_samples(split_run, small_data, tmp_path):
    """The same run with the engine in the trainer's process: the same samples at every step (segments are counted
    in tokens, never in time)."""
    local = run_inflight(tmp_path / "local", small_data, 3)
    straight = trained(split_run)
    assert trained(local) == {s: straight[s] for s in (1, 2, 3)}


SLOW_EQ_ENV = '''
import importlib.util, os, time
spec = importlib.util.spec_from_file_location("eq", os.path.join({root!r}, "environments", "eq.py"))
eq = importlib.util.module_from_spec(spec); spec.loader.exec_module(eq)

def reward_fn(messages, answer):
    time.sleep(0.3)  # a judge: the run is slow enough to be killed in the middle
    return eq.reward_fn(messages, answer)
'''


@pytest.mark.slow
def test_a_run_killed_after_its_checkpoint_resumes_on_the_same_samples(split_run, small_data, tmp_path):
    """The split run again with a slow judge (the same rewards), SIGKILLed (every process) once step 4 has begun; the
    resume from its latest checkpoint (step 3) trains steps 4-6 on exactly the straight run's samples and ends with
    its weights bit for bit."""
    import sys

    from conftest import kill_when
    from train.runtime.checkpoint import find_latest

    env_file = tmp_path / "slow_eq.py"
    env_file.write_text(SLOW_EQ_ENV.format(root=str(ROOT)))
    killed = tmp_path / "killed"
    common = [f"data.train_data_path={small_data}", "trainer.total_steps=6", *INFLIGHT, "trainer.save_freq=3",
              "rollout.ranks=1", "trainer.num_threads=1", f"rollout.env_path={env_file}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m",
           "train.trainer.grpo", "--config-name", "stub", "trainer.progress_bar=false", f"trainer.save_dir={killed}",
           *common]
    kill_when(cmd, killed, lambda: (killed / "metrics.jsonl").exists()
              and any(m["step"] >= 4 for m in read_jsonl(killed / "metrics.jsonl")), "step 4")
    assert not (killed / "step6").exists()
    latest = find_latest(str(killed))
    assert latest == str(killed / "step3")
    resumed = tmp_path / "resumed"
    run_trainer([f"trainer.save_dir={resumed}", *common, f"trainer.load_ckpt_from={latest}"], nproc=2)
    straight, again = trained(split_run), trained(resumed)
    assert sorted(again) == [4, 5, 6] and all(again[s] == straight[s] for s in (4, 5, 6))
    assert_same(consolidate(str(split_run / "step6")), consolidate(str(resumed / "step6")))


@pytest.mark.slow
def test_a_resume_on_fewer_ranks_loses_and_repeats_no_group(small_data, tmp_path):
    """2 ranks save at step 2 with groups in flight on both; 1 rank resumes: it takes both ranks' groups, and every
    group is trained once (or is still in flight at the end), none twice."""
    two = run_inflight(tmp_path / "two", small_data, 2, "trainer.save_freq=2", "trainer.num_threads=1", nproc=2)
    held = {g.uid for r in (0, 1) for g in saved_groups(two / "step2", r)}
    assert held and all(saved_groups(two / "step2", r) for r in (0, 1))
    one = run_inflight(tmp_path / "one", small_data, 5, "trainer.save_freq=5",
                       f"trainer.load_ckpt_from={two / 'step2'}")
    before = {uid for samples in trained(two).values() for uid, _, _ in samples}
    after = Counter(uid for samples in trained(one).values() for uid, _, _ in samples)
    left = {g.uid for g in saved_groups(one / "step5", 0)}
    assert not before & set(after) and set(after.values()) == {4}  # each group once, whole
    assert held <= set(after) | left


# -- continuous segments ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def continuous_run(tmp_path_factory, small_data):
    """8 continuous in-flight steps on 1 trainer rank + 1 rollout rank, a checkpoint at 4 and an evaluation at 4."""
    return run_inflight(tmp_path_factory.mktemp("continuous"), small_data, 8, "rollout.inflight_mode=continuous",
                        "trainer.save_freq=4", "trainer.test_freq=4", "rollout.ranks=1", "trainer.num_threads=1",
                        nproc=2)


def test_continuous_segments_keep_the_bound_and_every_group_whole(continuous_run):
    """Segments run back to back while the trainer trains: every sample within 2 versions when trained, groups
    trained whole and once, the evaluation and the checkpoint in between."""
    metrics, steps = metrics_by_step(continuous_run), trained(continuous_run)
    assert sorted(steps) == list(range(1, 9)) and "rewards/test" in metrics[4] and "rewards/test" in metrics[8]
    for step, samples in steps.items():
        assert all(step - 1 - min(v) <= 2 and max(v) <= max(step - 1, 0) for _, _, v in samples)
        assert metrics[step]["async/staleness_max"] <= 2 and metrics[step]["async/segments"] >= 0
    uids = Counter(uid for samples in steps.values() for uid, _, _ in samples)
    assert set(uids.values()) == {4} and len(uids) == 8 * 4


def test_a_continuous_resume_continues_every_group_in_flight(continuous_run, small_data, tmp_path):
    """Resumed from step 4 (groups in flight, generated or not): every group the checkpoint held is trained in
    steps 5-8 or still in flight at the end; none is trained twice across the two runs."""
    held = {g.uid for g in saved_groups(continuous_run / "step4", 0)}
    resumed = run_inflight(tmp_path / "resumed", small_data, 8, "rollout.inflight_mode=continuous",
                           "trainer.save_freq=4", "rollout.ranks=1", "trainer.num_threads=1",
                           f"trainer.load_ckpt_from={continuous_run / 'step4'}", nproc=2)
    before = {uid for s in range(1, 5) for uid, _, _ in trained(continuous_run)[s]}
    after = Counter(uid for samples in trained(resumed).values() for uid, _, _ in samples)
    left = {g.uid for g in saved_groups(resumed / "step8", 0)}
    assert held and not before & set(after) and set(after.values()) == {4}
    assert held <= set(after) | left


STUCK_JUDGE_ENV = '''
import asyncio

async def reward_fn(messages, answer):
    await asyncio.sleep(300)  # a judge that does not answer in time
    return 1.0
'''


def test_a_continuous_wait_for_a_step_s_groups_times_out_naming_it(small_data, tmp_path):
    """The trainer waits rollout.async_timeout_s for a step's groups, then fails with one line naming the step, what
    it had and the key, at once: the run does not wait for the stuck judge on its way out (it used to give the
    segment in flight 60 s to end)."""
    env_file = tmp_path / "stuck_judge.py"
    env_file.write_text(STUCK_JUDGE_ENV)
    start = time.monotonic()
    out = run_trainer([f"trainer.save_dir={tmp_path / 'run'}", f"data.train_data_path={small_data}",
                       "trainer.total_steps=2", *INFLIGHT, "rollout.inflight_mode=continuous",
                       f"rollout.env_path={env_file}", "rollout.async_timeout_s=2", "rollout.env_timeout_s=300"],
                      check=False, timeout=120)
    assert out.returncode != 0
    assert "rollout.async_timeout_s" in out.stderr and "step 1's 4 groups (0 generated and scored" in out.stderr
    assert time.monotonic() - start < 45  # start-up and 2 s of waiting; not the segment's 60 s nor the judge's 300


# -- the bound -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["requeue", "finish"])
def test_samples_past_the_bound_are_requeued_or_trained_and_counted(policy, small_data, tmp_path):
    """Bound 1 and more groups in flight than a step trains: done groups wait, so some would be trained 2 versions
    old. requeue starts them again from their prompt (none trained
    past the bound); finish trains them past it. Either way they are counted with their lengths, and no group is
    dropped."""
    run = run_inflight(tmp_path / policy, small_data, 5, "rollout.max_staleness=1", "rollout.segment_tokens=6",
                       "rollout.inflight_groups=12", f"rollout.over_stale={policy}")
    metrics = metrics_by_step(run)
    over = sum(m["async/over_stale_share"] for m in metrics.values())
    assert over > 0
    events = [e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "over_stale"]
    assert events and all(e["policy"] == policy and len(e["tokens"]) == e["samples"] for e in events)
    worst = max(m["async/staleness_max"] for m in metrics.values())
    assert worst == 1 if policy == "requeue" else worst >= 2
    uids = Counter(uid for samples in trained(run).values() for uid, _, _ in samples)
    assert set(uids.values()) == {4} and len(uids) == 4 * 5


def test_dynamic_sampling_and_a_curriculum_keep_working_in_flight(small_data, tmp_path):
    """DAPO's dynamic sampling refills from the groups in flight: every step trains exactly its share of informative
    groups (the others are dropped and counted, never trained); a prioritized curriculum admits prompts with the pass
    rates recorded so far."""
    run = run_inflight(tmp_path / "dapo", small_data, 4, "rollout.dynamic_sampling=true",
                       "data.curriculum.policy=prioritized")
    for step, m in metrics_by_step(run).items():
        assert m["batch/groups"] == 4 and m["dynamic_sampling/groups"] == 4
    trained_uids = Counter(uid for samples in trained(run).values() for uid, _, _ in samples)
    assert set(trained_uids.values()) == {4}
    stats = [e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "sample"]
    assert len({s["uid"] for s in stats}) >= 16  # (the logged samples include the dropped groups)


def test_inflight_settings_are_checked():
    from train.trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match="rollout.max_staleness.*must be >= 1 with rollout.inflight"):
        validate(compose_config(["rollout.inflight=true"]))
    with pytest.raises(ConfigError, match=r"rollout.segment_tokens.*started again forever.*rollout.segment_tokens=6"):
        validate(compose_config(["rollout.inflight=true", "rollout.max_staleness=2", "rollout.segment_tokens=4"]))
    with pytest.raises(ConfigError, match="rollout.inflight_groups"):
        validate(compose_config(["rollout.inflight=true", "rollout.max_staleness=1", "rollout.inflight_groups=2"]))
    with pytest.raises(ConfigError, match="rollout.over_stale"):
        validate(compose_config(["rollout.inflight=true", "rollout.max_staleness=1", "rollout.over_stale=drop"]))
    with pytest.raises(ConfigError, match="stop strings"):
        validate(compose_config(["rollout.inflight=true", "rollout.max_staleness=1",
                                 "rollout.train_sampling_params.stop=['</answer>']"]))
    validate(compose_config(["rollout.inflight=true", "rollout.max_staleness=2", "rollout.segment_tokens=6",
                             "rollout.over_stale=finish"]))
    validate(compose_config(["rollout.inflight=true", "rollout.max_staleness=2", "rollout.segment_tokens=2",
                             "rollout.over_stale=finish"]))


def test_a_checkpoint_with_groups_in_flight_needs_an_inflight_resume(split_run, small_data, tmp_path):
    """Resuming it without rollout.inflight would lose the prompts in flight: refused, naming the key."""
    out = run_trainer([f"trainer.save_dir={tmp_path / 'sync'}", f"data.train_data_path={small_data}",
                       "trainer.total_steps=4", "data.prompts_per_rollout=4", "data.responses_per_prompt=4",
                       "trainer.test_freq=null", f"trainer.load_ckpt_from={split_run / 'step3'}"], check=False)
    assert out.returncode != 0 and "resume with rollout.inflight=true" in out.stderr
