"""Bounded conversations at both ends (issue 33, items 1 and 2): a row whose prompt fills the context is
skipped (or fails the run) with its file, row and token count named, never trained, counted; a huge env
reply is cut in characters before it is tokenized, and the cut is recorded."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import STUB_MATH, read_jsonl, run_config, run_trainer
from train.datasets.errors import DataError
from train.datasets.loading import load_rows
from train.engines.base import Generation, SamplingParams
from train.trainer import step as st
from train.trainer.data_check import Context, PromptOverflowLog, check_data
from train.workers.environment import Environment
from train.workers.rollout import PROMPT_TOO_LONG, RolloutWorker

CTX = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)  # no process group: sums are local
LONG = "x " * 2500  # ~5000 stub tokens: past the stub's 512-token context


def cfg(**overrides):
    """The run's typed config (config/grpo.yaml) with `overrides`."""
    return run_config(overrides)


def math_rows(path: Path, n: int, long_every: int | None = 2, long_from: int = 0) -> Path:
    """The first `n` stub math rows, every `long_every`-th one from index `long_from` on (1 = all of them
    from there) prefixed with ~5000 tokens; the issue's reproduction is n=8, long_every=2, long_from=1."""
    rows = [json.loads(line) for line in (STUB_MATH / "train.jsonl").read_text().splitlines()[:n]]
    for i, row in enumerate(rows):
        if long_every and i >= long_from and (i - long_from) % long_every == 0:
            row["messages"][0]["content"] = LONG + row["messages"][0]["content"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class CountingEngine:
    """Two sampled tokens then EOS per call; counts the calls and the longest prompt it was given."""
    weight_version = 0

    def __init__(self, eos: int):
        self.eos, self.calls, self.longest = eos, 0, 0

    async def generate(self, prompt_ids, sampling):
        self.calls += 1
        self.longest = max(self.longest, len(prompt_ids))
        return Generation([5, 6, self.eos], [-0.5] * 3, "stop")

    def close(self):
        pass


class CountingTokenizer:
    """The stub tokenizer, counting the characters of every text handed to `encode`."""

    def __init__(self, tok):
        self._tok, self.encoded = tok, []

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self._tok.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def env_file(tmp_path: Path, interact: str, name: str = "env.py") -> Environment:
    path = tmp_path / name
    path.write_text(f"CALLS = []\n\ndef interact(messages):\n    {interact}\n\n"
                    "def reward_fn(messages, answer):\n    CALLS.append(1)\n    return 1.0\n")
    return Environment(str(path), timeout_s=30, max_workers=2, max_turns=3)


# -- item 1: prompts that fill the context -----------------------------------------------------------

def test_a_row_whose_prompt_fills_the_context_is_skipped_and_named(tmp_path, stub_tokenizer):
    """Its samples hold no token, are never generated or scored, and carry finish reason
    `prompt_too_long` with an event naming the file, the row (its line), the tokens and the limit."""
    rows = load_rows(str(math_rows(tmp_path / "train.jsonl", 4, long_every=2, long_from=1)))
    engine = CountingEngine(stub_tokenizer.eos_token_id)
    env = env_file(tmp_path, "return []")
    worker = RolloutWorker(engine, env, stub_tokenizer, max_turns=1, env_error_reward=0.0, max_total_length=512)
    samples, _ = worker.rollout(rows, 2, SamplingParams(max_new_tokens=4), 0)
    worker.close()
    skipped = [s for s in samples if s.finish_reason == PROMPT_TOO_LONG]
    assert [s.group for s in skipped] == [1, 1, 3, 3]
    assert all(s.ids == [] and s.n_action_tokens == 0 and s.reward == 0.0 for s in skipped)
    assert skipped[0].events == [{"type": "prompt_too_long", "row": f"{tmp_path / 'train.jsonl'}: row 2",
                                  "tokens": skipped[0].prompt_length, "limit": 512}]
    assert skipped[0].prompt_length > 5000
    assert engine.calls == 4 and engine.longest < 512  # only the two short rows, twice each
    assert len(env.module.CALLS) == 4  # and only they were scored


def test_skipped_rows_are_never_trained_and_are_counted_apart():
    """select_groups drops a skipped row's group even without dynamic filtering; the metrics count it in
    prompt_overflow_ratio and context_overflow_ratio and leave it out of every per-sample mean."""
    from train.workers.rollout import Sample

    def sample(group, reward, skipped=False):
        if skipped:
            return Sample(group, [], None, [], [], [], finish_reason=PROMPT_TOO_LONG, prompt_length=600)
        return Sample(group, [], None, [1, 2, 3, 4], [0, 0, 1, 1], [0.0] * 4, reward=reward, prompt_length=2,
                      n_turns=1, turn_lengths=[2])

    samples = [sample(0, 1.0), sample(0, 0.0), sample(1, 0.0, True), sample(1, 0.0, True)]
    st.shape_rewards(samples, cfg().rollout)
    kept = st.select_groups(samples, 2, dynamic_filtering=False)
    assert kept == samples[:2]
    m = st.rollout_metrics(samples, 2, 2, cfg().rollout, CTX)
    assert m["prompt_overflow_ratio/train"] == 0.5 and m["context_overflow_ratio/train"] == 0.5
    assert m["rewards/train"] == 0.5 and m["prompt_length/train"] == 2.0 and m["response_length/train"] == 2.0
    assert m["trajectory_length/train_max"] == 4 and m["dynamic_filtering_ratio"] == 0.0  # the one real group


def data_cfg(**overrides):
    return cfg(**{"data.contamination_ngram": 13, **overrides}).data


def test_the_start_up_check_warns_fails_or_refuses_an_all_long_data_set(tmp_path, stub_tokenizer):
    """skip: one warning naming the file, rows, tokens and limit; fail: the first such row as an error
    naming the key to change; every checked prompt too long: an error before training either way."""
    context = Context(512, "rollout.max_total_length=512")
    path = math_rows(tmp_path / "train.jsonl", 6, long_every=2, long_from=1)
    rows = load_rows(str(path))
    found = check_data(data_cfg(), rows, [], {}, stub_tokenizer, context)
    assert found.overlong_rows == [f"{path}: row {n}" for n in (2, 4, 6)]
    (line,) = found.warnings
    assert line.startswith(f"{path}: row 2: the prompt is 5014 tokens with its chat template, as long as the "
                           "512-token context (rollout.max_total_length=512) or longer")
    assert "data.overlong_prompts=skip" in line and f"{path}: row 6 (5014 tokens)" in line

    with pytest.raises(DataError, match=rf"^{path}: row 2: the prompt is 5014 tokens .*data.overlong_prompts=skip"):
        check_data(data_cfg(**{"data.overlong_prompts": "fail"}), rows, [], {}, stub_tokenizer, context)

    every = load_rows(str(math_rows(tmp_path / "all.jsonl", 4, long_every=1)))
    with pytest.raises(DataError, match=r"^data.train_data_path: all 4 prompts are as long as the 512-token "
                                        r"context .* the run would skip every step"):
        check_data(data_cfg(), every, [], {}, stub_tokenizer, context)


def test_the_start_up_check_tokenizes_only_the_first_check_rows_of_each_source(tmp_path, stub_tokenizer):
    """data.check_rows bounds the start-up cost: rows past it are left to the rollout's own check."""
    context = Context(512, "rollout.max_total_length=512")
    rows = load_rows(str(math_rows(tmp_path / "train.jsonl", 6, long_every=1, long_from=3)))  # rows 4-6 long
    counting = CountingTokenizer(stub_tokenizer)
    assert check_data(data_cfg(**{"data.check_rows": 3}), rows, [], {}, counting, context).warnings == []
    assert len(counting.encoded) == 3
    assert check_data(data_cfg(**{"data.check_rows": None}), rows, [], {}, stub_tokenizer, context).warnings


def test_rows_skipped_at_rollout_are_named_once_then_counted():
    """Rows already named (at start-up, or earlier) are not named again; after five, rows are counted
    in a line each time the number of skipped draws doubles."""
    context = Context(512, "rollout.max_total_length=512")
    log = PromptOverflowLog(context, known=["f.jsonl: row 1"])
    event = lambda n: {"type": "prompt_too_long", "row": f"f.jsonl: row {n}", "tokens": 600, "limit": 512}  # noqa: E731
    assert log.add([event(1), event(1)]) == []
    lines = log.add([event(2), event(2), event(3)])
    assert lines == [f"f.jsonl: row {n}: the prompt is 600 tokens with its chat template, as long as the 512-token "
                     "context (rollout.max_total_length=512) or longer, so nothing can be sampled: the row is skipped "
                     "(data.overlong_prompts=skip)" for n in (2, 3)]
    lines = log.add([event(n) for n in range(4, 30)])
    assert len(lines) == 4 and lines[2].endswith("further such rows are counted here, not named (each is in "
                                                 "trajectories.jsonl)")
    assert lines[3].startswith("31 draws of rows skipped so far")  # past 10 and 20
    assert log.add([event(40)] * 8) == [] and log.add([event(40)]) == [
        "40 draws of rows skipped so far for prompts that fill the context (prompt_overflow_ratio/train; a "
        "`prompt_too_long` event each in trajectories.jsonl)"]


def test_the_issue_s_over_long_prompts_are_skipped_with_a_warning_on_two_ranks(tmp_path):
    """The issue's reproduction: 8 rows, every other prompt ~5000 tokens, 3 steps on 2 ranks. The run
    warns on the console naming the file, the rows, the tokens and the limit, counts the skipped
    samples, trains on the others, and writes a `prompt_too_long` event per skipped row."""
    data = math_rows(tmp_path / "train.jsonl", 8, long_every=2, long_from=1)
    run = tmp_path / "run"
    proc = run_trainer([f"trainer.save_dir={run}", f"data.train_data_path={data}", "data.prompts_per_rollout=4",
                        "trainer.total_steps=3", "trainer.test_freq=null"], nproc=2)
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.startswith("warning:")]
    assert any(f"{data}: row 2: the prompt is 5014 tokens" in w and "512-token context" in w and f"{data}: row 8"
               in w for w in warnings), proc.stdout + proc.stderr
    assert "Token indices sequence length" not in proc.stderr  # transformers' anonymous line is gone
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["prompt_overflow_ratio/train"] > 0 and m["context_overflow_ratio/train"] >= m[
        "prompt_overflow_ratio/train"] for m in metrics)
    assert all(m["prompt_length/train"] < 100 for m in metrics)  # the skipped prompts are not averaged in
    events = read_jsonl(run / "trajectories.jsonl")
    skipped = [e for e in events if e["type"] == "prompt_too_long"]
    assert skipped and {e["row"] for e in skipped} <= {f"{data}: row {n}" for n in (2, 4, 6, 8)}
    assert all(e["tokens"] == 5014 and e["limit"] == 512 for e in skipped)
    assert [e for e in events if e["type"] == "warning" and f"{data}: row 2" in e["warning"]]


def test_an_all_long_data_set_is_an_error_before_training(tmp_path):
    data = math_rows(tmp_path / "train.jsonl", 8, long_every=1)
    run = tmp_path / "run"
    proc = run_trainer([f"trainer.save_dir={run}", f"data.train_data_path={data}", "data.prompts_per_rollout=4",
                        "trainer.total_steps=3", "trainer.test_freq=null"], check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and errors[0].startswith("error: data.train_data_path: all 8 prompts are as long as the 512-token "
                                           "context"), proc.stderr[-3000:]
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_fail_stops_the_run_at_the_first_long_row_drawn_past_the_checked_ones(tmp_path):
    """data.overlong_prompts=fail with the long rows past data.check_rows: the rollout finds the row
    and every rank stops with the error line naming it (exit status 2, the user-error status)."""
    data = math_rows(tmp_path / "train.jsonl", 8, long_every=1, long_from=4)  # rows 5-8 long, 1-4 checked
    run = tmp_path / "run"
    proc = run_trainer([f"trainer.save_dir={run}", f"data.train_data_path={data}", "data.prompts_per_rollout=8",
                        "data.responses_per_prompt=2", "trainer.total_steps=2", "trainer.test_freq=null",
                        "data.overlong_prompts=fail", "data.check_rows=4"], nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {data}: row ") and "5014 tokens" in errors[0]
    assert "data.overlong_prompts=skip" in errors[0] and "rollout.max_total_length" in errors[0]


# -- item 2: env output bounded before tokenization --------------------------------------------------

def test_a_1mb_env_reply_is_cut_before_it_is_tokenized(tmp_path, stub_tokenizer):
    """The 1 MB reply reaches the tokenizer as at most 16 characters per token of context left; the
    cut is an `env_truncated` event, and what is kept still does not fit: the episode ends (`context`)."""
    tok = CountingTokenizer(stub_tokenizer)
    engine = CountingEngine(stub_tokenizer.eos_token_id)
    env = env_file(tmp_path, "return [{'role': 'tool', 'content': 'x' * 1_000_000}]")
    worker = RolloutWorker(engine, env, tok, max_turns=3, env_error_reward=0.0, max_total_length=512)
    rows = [{"messages": [{"role": "user", "content": "1 + 1"}], "answer": "2"}]
    (sample,), _ = worker.rollout(rows, 1, SamplingParams(max_new_tokens=4), 0)
    worker.close()
    assert max(tok.encoded) < 512 * 16 + 1000, max(tok.encoded)  # was 1,000,000+ (twice per turn)
    cut, overflow = sample.events
    assert cut["type"] == "env_truncated" and cut["turn"] == 0 and cut["chars"] == 1_000_000
    assert cut["kept"] == overflow["room"] * 16  # 16 characters per token left
    assert overflow["type"] == "context_overflow" and overflow["env_tokens"] > overflow["room"]
    assert sample.finish_reason == "context" and len(sample.ids) <= 512


def test_rollout_max_env_chars_cuts_a_reply_that_then_fits(tmp_path, stub_tokenizer):
    """With rollout.max_env_chars the kept part of a long reply joins the conversation, recorded; a
    reply within the bound is untouched and records nothing."""
    engine = CountingEngine(stub_tokenizer.eos_token_id)
    env = env_file(tmp_path, "return [{'role': 'tool', 'content': 'ab' * 100}]")
    worker = RolloutWorker(engine, env, stub_tokenizer, max_turns=3, env_error_reward=0.0, max_total_length=512,
                           max_env_chars=100)
    rows = [{"messages": [{"role": "user", "content": "1 + 1"}], "answer": "2"}]
    (sample,), _ = worker.rollout(rows, 1, SamplingParams(max_new_tokens=4), 0)
    assert sample.events[0] == {"type": "env_truncated", "turn": 0, "chars": 200, "kept": 100}
    assert sample.events[1]["type"] == "tool" and sample.events[1]["messages"][0]["content"] == "ab" * 50
    assert sample.messages[2] == {"role": "tool", "content": "ab" * 50} and sample.finish_reason == "stop"
    assert sample.n_turns == 3 and [e["type"] for e in sample.events] == ["env_truncated", "tool"] * 2
    worker.max_env_chars = 1000
    (sample,), _ = worker.rollout(rows, 1, SamplingParams(max_new_tokens=4), 0)
    assert [e["type"] for e in sample.events] == ["tool", "tool"]
    worker.close()


def test_env_truncated_ratio_is_a_metric():
    from train.workers.rollout import Sample

    cut = [{"type": "env_truncated", "turn": 0, "chars": 10, "kept": 5}]
    samples = [Sample(0, [], None, [1, 2], [0, 1], [0.0] * 2, events=events, n_turns=1, turn_lengths=[1])
               for events in (cut, [], [], [])]
    assert st.rollout_metrics(samples, 2, 2, cfg(**{"rollout.max_turns": 2}).rollout, CTX)["env/truncated_ratio/train"] == 0.25
