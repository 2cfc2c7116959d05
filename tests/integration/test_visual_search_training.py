"""The visual search agent trained for real (config/visual_search_stub.yaml, docs/vision.md): GSPO on 2 ranks
with the three services started from their documented commands on free 127.0.0.1 ports - the image service
(environments/image_search_service.py over the bundled slides), the frozen generator (`train.serve` serving
the policy's starting folder, image_url parts) and the judge (`train.serve` serving the search demo's tiny text
model). The policy is stub/build_vision_search_model.py's, built once and cached like search-tiny. Two steps:
the run finishes, the policy searched (slides came back as images) and cropped (crops came back), and the
generator and judge were called for the episodes that completed."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, SERVICE_ENV, free_port, load_file, read_jsonl, run_config, run_trainer, running_all

DATA = ROOT / "stub" / "data" / "visual_search"


@pytest.fixture(scope="session")
def vsearch_policy(request) -> Path:
    """stub/build_vision_search_model.py's policy (its default warm start), cached across sessions."""
    build = load_file(ROOT / "stub" / "build_vision_search_model.py")
    return build.cached(request.config.cache.mkdir("vsearch-policy"))


def services(commands: dict[str, tuple[list[str], str]], logs: Path, timeout: float = 180.0):
    """Start every command at once (they load their models side by side), wait until each health URL
    answers 200, stop them all afterwards."""
    return running_all({name: (cmd, health, logs / f"{name}.log") for name, (cmd, health) in commands.items()},
                       timeout=timeout, cwd=ROOT, env={**SERVICE_ENV, "OMP_NUM_THREADS": "1"})


def test_the_preset_is_gspo_multi_turn_on_the_visual_search_data():
    cfg = run_config(name="visual_search_stub")
    assert cfg.actor.loss == "gspo" and cfg.actor.agg_mode == "seq_mean_token_mean"
    assert cfg.rollout.env_path == "environments/visual_search.py" and cfg.rollout.max_turns >= 3
    for path in (cfg.data.train_data_path, cfg.data.test_data_path):
        assert (ROOT / path).is_file() and Path(path).parent == DATA.relative_to(ROOT)
    # the policy has 1024 positions; a rank's batch fits one pack (see the preset's comment)
    assert cfg.rollout.max_total_length == 1024
    per_rank = cfg.data.prompts_per_rollout * cfg.data.responses_per_prompt // 2
    assert cfg.actor.max_length_per_device >= per_rank * cfg.rollout.max_total_length
    assert not cfg.rollout.dynamic_filtering


@pytest.mark.slow
def test_two_gspo_steps_on_two_ranks_search_and_crop(tmp_path, vsearch_policy, search_tiny):
    search, generator, judge = free_port(), free_port(), free_port()
    commands = {
        "image_search": ([sys.executable, "environments/image_search_service.py", "--corpus_path",
                          str((DATA / "corpus.jsonl").relative_to(ROOT)), "--top_k", "3", "--port", str(search)],
                         f"http://127.0.0.1:{search}/health"),
        "generator": ([sys.executable, "-m", "train.serve", "--model", str(vsearch_policy), "--served-model-name",
                       "generator", "--port", str(generator), "--threads", "1"], f"http://127.0.0.1:{generator}/health"),
        "judge": ([sys.executable, "-m", "train.serve", "--model", search_tiny, "--served-model-name", "judge",
                   "--port", str(judge), "--threads", "1"], f"http://127.0.0.1:{judge}/health"),
    }
    save = tmp_path / "run"
    started = time.monotonic()
    with services(commands, tmp_path):
        ready = time.monotonic() - started
        env = dict(VSEARCH_URL=f"http://127.0.0.1:{search}",
                   GENERATOR_BASE_URL=f"http://127.0.0.1:{generator}/v1", GENERATOR_MODEL="generator",
                   GENERATOR_MAX_TOKENS="16", JUDGE_BASE_URL=f"http://127.0.0.1:{judge}/v1", JUDGE_MODEL="judge",
                   JUDGE_MAX_RETRIES="0", RM_JUDGE_COEF="0.1", RM_NDCG_COEF="0.9")
        run_trainer([f"trainer.save_dir={save}", f"actor.model_name={vsearch_policy}", "trainer.total_steps=2",
                     "trainer.test_freq=null", "data.prompts_per_rollout=4", "data.responses_per_prompt=8"],
                    nproc=2, config="visual_search_stub", timeout=300, env=env)
    print(f"services healthy after {ready:.1f}s, all done after {time.monotonic() - started:.1f}s")

    metrics = read_jsonl(save / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert (save / "latest" / "model.safetensors").exists()  # the run finished and exported
    total = lambda key: sum(m.get(key, 0) for m in metrics)  # noqa: E731
    assert total("api/image_search/count") > 0 and total("api/image_search/errors") == 0
    assert total("api/crop/count") - total("api/crop/errors") > 0  # valid crops (invalid boxes are errors)
    samples = [e for e in read_jsonl(save / "trajectories.jsonl") if e["type"] == "sample"]
    assert len(samples) == 2 * 4 * 8  # trainer.log_samples covers every sample: NDCG is computed from them
    tools = [m for s in samples for m in s["messages"] if m["role"] == "tool"]
    shown = [m for m in tools if m.get("doc_ids")]
    crops = [m for m in tools if "crop_of" in m]
    assert shown and crops
    # slides and crops came back as images (described in the log: "<Image 128x128>" style)
    assert all(any(p.get("type") == "image" for p in m["content"]) for m in shown + crops)
    assert all(p["image"].endswith("x128>") for m in shown for p in m["content"] if p.get("type") == "image")
    # the generator and the judge were called for the completed episodes
    assert total("api/generator/count") > 0 and total("api/judge/count") > 0
    curves = load_file(ROOT / "environments" / "visual_search_curves.py")
    records = curves.curves(save)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["visual_search/search_rate"] > 0.5 and r["visual_search/samples"] == 32 for r in records)
    print(json.dumps(records))
