"""Model names through the Hugging Face Hub (train/utils/hub.py): ids from an offline cache built in
the Hub's layout, downloads from a FAKE Hub served over HTTP on 127.0.0.1 (tests/fake_hub.py; the
real Hub cannot be reached here), retries with backoff, one download per node, and one clear line
for every way it can fail."""
from __future__ import annotations

import os

import httpx
import pytest

from conftest import STUB_HUB_ID, STUB_MODEL, read_jsonl, run_trainer, slow
from fake_hub import FakeHub
from train.utils import hub

FAST = hub.RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


@pytest.fixture
def online(tmp_path, monkeypatch):
    """Downloads on (huggingface_hub reads HF_HUB_OFFLINE once, at import), into a fresh cache;
    returns a function that points huggingface_hub at a server."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    return lambda url: monkeypatch.setenv("HF_ENDPOINT", url)


class HTTPStatusError(Exception):
    """An error shaped like huggingface_hub's HTTP errors (a `response` with status and headers)."""

    def __init__(self, status: int, retry_after: str | None = None) -> None:
        super().__init__(f"status {status}")
        self.response = httpx.Response(status, headers={"Retry-After": retry_after} if retry_after else {})


def test_repo_id_shapes() -> None:
    assert hub.looks_like_repo_id("Qwen/Qwen2-1.5B-Instruct") and hub.looks_like_repo_id("gpt2")
    for path in ("/models/x", "./x", "~/x", "a/b/c", "..", "x/"):
        assert not hub.looks_like_repo_id(path), path


def test_backoff_doubles_honours_retry_after_and_stops_on_permanent_errors() -> None:
    slept: list[float] = []
    errors = [HTTPStatusError(503), HTTPStatusError(429, retry_after="7"), ConnectionError("reset"),
              HTTPStatusError(502)]

    def flaky() -> str:
        if errors:
            raise errors.pop(0)
        return "folder"

    policy = hub.RetryPolicy(attempts=5, base_delay_s=1.0, max_delay_s=3.0)
    assert hub.with_backoff(flaky, "'x'", policy, slept.append) == "folder"
    # 1 s (x jitter <= 1.25), then Retry-After 7 capped at 3, then 4 -> capped 3, then capped 3
    assert 1.0 <= slept[0] <= 1.25 and slept[1:] == [3.0, 3.0, 3.0]

    slept.clear()
    with pytest.raises(hub.ModelNotFound, match="download failed after 3 attempts.*try again later"):
        hub.with_backoff(lambda: (_ for _ in ()).throw(HTTPStatusError(500)), "'x'",
                         hub.RetryPolicy(attempts=3, base_delay_s=0.5), slept.append)
    assert slept == pytest.approx([0.5, 1.0], rel=0.25)

    calls = []
    with pytest.raises(HTTPStatusError):  # 404 and the like are not retried
        hub.with_backoff(lambda: calls.append(1) or (_ for _ in ()).throw(HTTPStatusError(404)), "'x'", policy,
                         slept.append)
    assert len(calls) == 1


def test_offline_cache_resolves_and_uncached_ids_say_what_to_do(stub_hub_cache, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(stub_hub_cache))
    folder = hub.resolve(STUB_HUB_ID)
    assert folder.startswith(str(stub_hub_cache)) and os.path.exists(os.path.join(folder, "model.safetensors"))
    assert hub.resolve(str(STUB_MODEL)) == str(STUB_MODEL)  # a folder is used as is
    with pytest.raises(hub.ModelNotFound, match=r"'nobody/nothing' is not a local folder .*HF_HUB_OFFLINE=1"):
        hub.resolve("nobody/nothing")
    with pytest.raises(hub.ModelNotFound, match="path '/no/such/model' does not exist"):
        hub.resolve("/no/such/model")


def test_download_retries_rate_limits_then_reads_the_cache(online) -> None:
    with FakeHub({"org/stub": STUB_MODEL}, fail_first=3, fail_status=429) as server:
        online(server.url)
        folder = hub.resolve("org/stub", policy=FAST)
        assert sorted(os.listdir(folder)) == sorted(p.name for p in STUB_MODEL.iterdir() if p.is_file())
        assert server.file_count("model.safetensors") == 1
        assert hub.resolve("org/stub", local_files_only=True) == folder  # from the cache, no request
        assert server.file_count("model.safetensors") == 1
        with pytest.raises(hub.ModelNotFound, match="no such model exists on the Hugging Face Hub"):
            hub.resolve("org/missing", policy=FAST)


def test_a_hub_that_stays_down_fails_after_the_retries(online) -> None:
    with FakeHub({"org/stub": STUB_MODEL}, fail_first=100, fail_status=503) as server:
        online(server.url)
        with pytest.raises(hub.ModelNotFound, match="'org/stub': download failed after 4 attempts"):
            hub.resolve("org/stub", policy=FAST)


def test_gated_repositories_need_hf_token(online, monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub({"org/gated": STUB_MODEL}, token="hf_secret") as server:
        online(server.url)
        with pytest.raises(hub.ModelNotFound, match="gated.*set HF_TOKEN"):
            hub.resolve("org/gated", policy=FAST)
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert os.path.exists(os.path.join(hub.resolve("org/gated", policy=FAST), "config.json"))


def test_two_ranks_download_once_and_train(tmp_path) -> None:
    """torchrun, 2 ranks on one node, online against the fake Hub that rate-limits the first calls:
    local rank 0 fetches every file once (after retrying), rank 1 reads the cache, the run trains."""
    with FakeHub({"org/stub": STUB_MODEL}, fail_first=2, fail_status=429) as server:
        env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(tmp_path / "cache")}
        proc = run_trainer([f"trainer.save_dir={tmp_path / 'run'}", "actor.model_name=org/stub",
                            "trainer.total_steps=1", "trainer.test_freq=null"], nproc=2, env=env)
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            assert server.file_count(name) == 1, (name, server.requests)
    assert "429" in proc.stdout + proc.stderr  # the retry was reported
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]


@pytest.mark.parametrize("nproc", [1, slow(2)])
def test_uncached_id_offline_is_one_clear_line(tmp_path, stub_hub_cache, nproc) -> None:
    proc = run_trainer([f"trainer.save_dir={tmp_path}", "actor.model_name=nobody/nothing"], nproc=nproc,
                       check=False, env={"HF_HUB_CACHE": str(stub_hub_cache)})
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == [lines[0]] and "config key 'actor.model_name': 'nobody/nothing' is not a local folder" in lines[0]
    assert "HF_HUB_OFFLINE=1" in lines[0] and "ModelNotFound" not in proc.stderr  # no traceback of ours
