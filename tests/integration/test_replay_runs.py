"""Prioritized replay in real runs (data.replay.*): replayed groups join the batch with their sampler log-probs
and versions (the truncated IS weight corrects them), and a run resumes with its buffer exactly."""
from conftest import read_jsonl, run_trainer
from test_trainer import assert_same
from train.runtime.checkpoint import consolidate

REPLAY = ["data.prompts_per_rollout=8", "data.responses_per_prompt=4", "trainer.test_freq=null",
          "data.replay.enable=true", "data.replay.share=0.5", "data.replay.priority=advantage"]


def test_replayed_groups_train_off_policy_and_a_resume_keeps_the_buffer_exactly(tmp_path):
    """6 steps on 2 ranks, checkpoint at 3; 3 + resume + 3 equals 6 straight bit for bit (the draws after the
    resume come from the restored buffer); a resume on one rank says the buffer starts empty."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["trainer.total_steps=6", "trainer.save_freq=3", *REPLAY]
    run_trainer([f"trainer.save_dir={straight}", *common], nproc=2)
    metrics = read_jsonl(straight / "metrics.jsonl")
    assert metrics[0]["replay/groups"] == 0 and all(m["replay/groups"] > 0 for m in metrics[1:])
    assert all(m["replay/groups"] <= 4 for m in metrics)  # 0.5 x 4 prompts per rank, 2 ranks
    assert all(m["batch/groups"] >= m["replay/groups"] for m in metrics)
    assert all(1 <= m["replay/age"] <= 5 for m in metrics[1:])
    # replayed tokens were sampled by older weights: their share and KL by lag, and the IS weights' clipping
    assert any(m.get("actor/tokens_share_lag1", 0) > 0 for m in metrics[1:])
    assert all("actor/tis_clipped" in m for m in metrics)  # actor.tis_cap is on (2.0) with replay
    run_trainer([f"trainer.save_dir={resumed}", f"trainer.load_ckpt_from={straight / 'step3'}", *common], nproc=2)
    assert_same(consolidate(str(straight / "step6")), consolidate(str(resumed / "step6")))
    again = read_jsonl(resumed / "metrics.jsonl")
    assert [m["replay/groups"] for m in again] == [m["replay/groups"] for m in metrics[3:]]
    one = run_trainer([f"trainer.save_dir={tmp_path / 'one'}", f"trainer.load_ckpt_from={straight / 'step3'}",
                       *REPLAY, "trainer.total_steps=4"], nproc=1)
    assert "data.replay: the checkpoint's buffer was saved by 2 ranks, this run has 1: it starts empty" in one.stdout
