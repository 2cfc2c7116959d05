"""kl_to_start/test (train/trainer/drift.py): the policy's per-token log-ratio to its starting policy on the sampled
evaluation replies, on two ranks against plain transformers models in float64, and in a real run where the
forgetting gate judges it (trainer.forgetting.max_kl)."""
import pytest

from conftest import launch_check, read_jsonl, run_trainer, slow


@pytest.mark.parametrize("kind", [slow("reference", id="reference"), "lora"])  # (the same sums, another start model)
def test_kl_to_start_on_two_ranks_is_the_float64_log_ratio_overall_and_per_source(tmp_path, kind):
    """A perturbed actor against the KL reference loaded from its starting folder, or LoRA adapters against the
    base (adapters off); samples split unevenly over the ranks, two sources."""
    extra = ["--lora", "4"] if kind == "lora" else []
    r = launch_check(2, tmp_path / "drift.pt", "drift", *extra)
    assert r["got"].keys() == r["expected"].keys() == {"kl_to_start/test", "kl_to_start/test/a",
                                                         "kl_to_start/test/b"}
    for key, want in r["expected"].items():
        assert want > 0.1 and r["got"][key] == pytest.approx(want, rel=1e-5), key


def test_a_lora_run_logs_its_drift_from_the_start_and_the_gate_judges_it(tmp_path):
    """Step 0: the adapters are 0, so the policy is its base: kl_to_start 0 exactly, no alarm. After two updates
    it has moved, past a max_kl set below any move: an alarm naming the metric."""
    run = tmp_path / "run"
    proc = run_trainer([f"trainer.save_dir={run}", "actor.lora.rank=4", "actor.lr=1e-2", "trainer.total_steps=2",
                        "trainer.test_freq=2", "trainer.test_samples=2", "trainer.forgetting.max_kl=1e-6",
                        "data.prompts_per_rollout=4", "data.responses_per_prompt=4"], nproc=1)
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    assert rows[0]["kl_to_start/test"] == 0.0 and rows[0]["forgetting/alarm"] == 0.0
    assert rows[2]["kl_to_start/test"] > 1e-6 and rows[2]["forgetting/alarm"] == 1.0
    assert "forgetting: kl_to_start/test" in proc.stdout and "trainer.forgetting.max_kl=1e-06" in proc.stdout
