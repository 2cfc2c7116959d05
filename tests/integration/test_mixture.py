"""Multi-source mixtures: sources and weights, each row routed to its own environment, per-source
metrics, exact resume, and the errors for bad mixtures (issue 19)."""
import json
from collections import Counter

import pytest

from conftest import ROOT, compose_config, read_jsonl, run_trainer
from test_trainer import assert_same
from train.datasets.contamination import check_contamination
from train.datasets.dataloader import build_dataloader
from train.datasets.errors import DataError
from train.datasets.mixture import MixtureError, Source, check_routes, load_sources, mixture_shares, parse_sources
from train.runtime.checkpoint import consolidate
from train.trainer.config import ConfigError, validate

STUB_DATA = ROOT / "stub" / "data"


def test_sources_from_a_path_a_list_and_a_mapping():
    assert parse_sources("a/train.jsonl", "k") == [Source(None, "a/train.jsonl")]
    assert parse_sources(["m/math.jsonl", "c/code.jsonl"], "k") == [Source("math", "m/math.jsonl"),
                                                                     Source("code", "c/code.jsonl")]
    got = parse_sources({"math": {"path": "m.jsonl", "weight": 3}, "code": {"path": "c.jsonl", "weight": 1}}, "k")
    assert got == [Source("math", "m.jsonl", 3.0), Source("code", "c.jsonl", 1.0)]


@pytest.mark.parametrize("value, weights, key, problem", [
    ({"math": {"path": "m.jsonl", "weight": 0}}, True, "k.math.weight", "must be a number > 0"),
    ({"math": {"path": "m.jsonl", "weight": -1.5}}, True, "k.math.weight", "must be a number > 0"),
    ({"math": {"path": "m.jsonl", "weight": 1}, "code": "c.jsonl"}, True, "k", "not for code"),
    ({"math": {"path": "m.jsonl", "weight": 1}}, False, "k.math.weight", "evaluated whole"),
    ({"math": {"file": "m.jsonl"}}, True, "k.math", "unknown field"),
    ({"math": {"weight": 1}}, True, "k.math.path", "expected a path string"),
    (["a/train.jsonl", "b/train.jsonl"], True, "k", "several paths are named 'train'"),
    ({}, True, "k", "empty mapping"),
    (3, True, "k", "expected a path, a list of paths or a mapping"),
])
def test_bad_mixtures_name_their_key(value, weights, key, problem):
    with pytest.raises(MixtureError, match=rf"config key '{key}': .*{problem}"):
        parse_sources(value, "k", weights=weights)


def test_rows_are_tagged_and_routes_checked_by_row():
    rows = load_sources([Source("math", str(STUB_DATA / "math" / "test.jsonl")),
                         Source("code", str(STUB_DATA / "code" / "test.jsonl"))])
    assert Counter(r["source"] for r in rows) == {"math": 256, "code": 10}
    check_routes(rows, {"math": 1, "code": 2}, "data.train_data_path")
    with pytest.raises(DataError, match=r"data\.train_data_path: \S*code/test\.jsonl: row 1: field 'source': 'code' "
                                        "has no environment"):
        check_routes(rows, {"math": 1}, "data.train_data_path")
    plain = load_sources([Source(None, str(STUB_DATA / "math" / "test.jsonl"))])
    with pytest.raises(DataError, match=r"math/test\.jsonl: row 1: field 'source': missing"):
        check_routes(plain, {"math": 1}, "data.train_data_path")


def _write_rows(path, rows: list[dict]) -> None:
    """`rows` as a JSONL, JSON or CSV file (CSV: `messages` as a JSON cell)."""
    import csv

    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["messages", "answer", "source"])
            writer.writeheader()
            for r in rows:
                writer.writerow({**r, "messages": r["messages"] if isinstance(r["messages"], str)
                                 else json.dumps(r["messages"])})


@pytest.mark.parametrize("suffix, row", [(".jsonl", 2), (".json", 2), (".csv", 3)])  # CSV: the header is line 1
def test_a_bad_source_and_a_bad_field_on_one_row_name_the_same_file_and_row(tmp_path, suffix, row):
    """A row naming a source with no environment was "row 1" for line 2 of a JSONL file (an index over
    every loaded row, no file), while a bad `messages` on the same line said "row 2": both now name the
    file and the row as the loader numbers it (from 1; by line in JSONL and CSV)."""
    good = {"messages": [{"role": "user", "content": "1+1"}], "answer": "2", "source": "math"}
    path = tmp_path / f"mixed{suffix}"
    _write_rows(path, [good, {**good, "source": "nope"}])
    rows = load_sources([Source(None, str(STUB_DATA / "math" / "test.jsonl"))]) + load_sources([Source(None, str(path))])
    for r in rows[:-2]:
        r["source"] = "math"
    with pytest.raises(DataError) as routed:
        check_routes(rows, {"math": 1}, "data.train_data_path")
    _write_rows(path, [good, {**good, "messages": "oops"}])
    with pytest.raises(DataError) as loaded:
        load_sources([Source(None, str(path))])
    assert str(routed.value).startswith(f"data.train_data_path: {path}: row {row}: field 'source': 'nope' has no "
                                        "environment"), routed.value
    assert str(loaded.value).startswith(f"{path}: row {row}: field 'messages'"), loaded.value


def test_a_mixtures_config_errors_name_the_key(tmp_path):
    mixture = "data.train_data_path={math: stub/data/math/train.jsonl, code: stub/data/code/train.jsonl}"
    for overrides, key in [
        ([mixture, "rollout.env_path={math: environments/eq.py}"], r"rollout\.env_path': source 'code'"),
        ([mixture, "rollout.env_path={math: environments/eq.py, code: environments/nope.py}"],
         r"rollout\.env_path\.code': path 'environments/nope\.py' does not exist"),
        (["data.train_data_path={math: {path: stub/data/math/train.jsonl, weight: 0}}"],
         r"data\.train_data_path\.math\.weight"),
    ]:
        with pytest.raises(ConfigError, match=key):
            validate(compose_config(overrides))


def weighted_loader(rank=0, world_size=1, shuffle=True):
    sources = [Source("a", "-", 3.0), Source("b", "-", 1.0)]
    rows = [{"source": "a", "i": i} for i in range(10)] + [{"source": "b", "i": i} for i in range(30)]
    kwargs = mixture_shares(sources, rows)
    return build_dataloader(rows, batch_size=4 // world_size, rank=rank, world_size=world_size, seed=5,
                            shuffle=shuffle, **kwargs), kwargs


@pytest.mark.parametrize("shuffle", [True, False])
def test_weights_set_each_sources_share_and_every_row_comes_back(shuffle):
    loader, kwargs = weighted_loader(shuffle=shuffle)
    # 40 rows, weights 3:1 -> an epoch of 30 rows of a (3 passes over its 10) and 10 of b (a third of its 30)
    assert kwargs == {"sizes": [10, 30], "shares": [30, 10]} and loader.batches_per_epoch == 10
    drawn = [(r["source"], r["i"]) for _ in range(30) for r in loader.next_batch()]  # 3 epochs
    for epoch in range(3):
        counts = Counter(s for s, _ in drawn[40 * epoch:40 * (epoch + 1)])
        assert counts == {"a": 30, "b": 10}
    a = [i for s, i in drawn if s == "a"]
    b = [i for s, i in drawn if s == "b"]
    # each source's stream is pass after pass over all its rows: nothing skipped, nothing twice in a pass
    assert all(sorted(a[k:k + 10]) == list(range(10)) for k in range(0, 90, 10))
    assert sorted(b) == list(range(30))
    if not shuffle:  # spread evenly: never more than 3 a-rows in a row
        order = "".join(s for s, _ in drawn[:40])
        assert "aaaa" not in order and "bb" not in order


def test_a_weighted_mixture_resumes_anywhere_and_splits_over_ranks():
    one, _ = weighted_loader()
    reference = [[r["i"] for r in one.next_batch()] for _ in range(25)]
    again, _ = weighted_loader()
    for _ in range(13):
        again.next_batch()
    state = json.loads(json.dumps(again.state_dict()))
    resumed, _ = weighted_loader()
    resumed.load_state_dict(state)
    assert [[r["i"] for r in resumed.next_batch()] for _ in range(12)] == reference[13:]
    ranks = [weighted_loader(rank, 2)[0] for rank in (0, 1)]
    for want in reference[:10]:
        got = [r["i"] for rank in ranks for r in rank.next_batch()]
        assert sorted(got) == sorted(want)


def test_contamination_is_counted_by_test_source():
    train = [{"messages": [{"role": "user", "content": "12 + 30"}], "source": "math"}]
    test = [{"messages": [{"role": "user", "content": "12 + 30"}], "source": "math"},
            {"messages": [{"role": "user", "content": "upper: abc"}], "source": "language"}]
    report = check_contamination(train, test)
    assert report.by_source == {"math": [1, 0, 1], "language": [0, 0, 1]}
    assert "by test source: language: 0 exact, 0 near of 1; math: 1 exact, 0 near of 1" in report.summary(13)


# An environment that raises for any row not of its source, so a misrouted row shows as an env
# error, and otherwise scores with the bundled environment it wraps.
GUARD = '''
import importlib.util, inspect, re

_spec = importlib.util.spec_from_file_location("{name}_wrapped", {path!r})
_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_env)


async def reward_fn(messages, answer):
    prompt = messages[-2]["content"]
    if not {check}:
        raise ValueError("a row of another source reached {name}: " + prompt[:40])
    value = _env.reward_fn(messages, answer)
    return await value if inspect.isawaitable(value) else value
'''

CHECKS = {"math": r're.fullmatch(r"\d+ \+ \d+", prompt)',
          "language": r're.fullmatch(r"[a-z]+: [a-z]+", prompt)',
          "code": 'isinstance(answer, dict) and "tests" in answer'}
ENVS = {"math": "eq.py", "language": "eq.py", "code": "code.py"}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """Training and test slices of three stub sources, and a guarded environment for each."""
    folder = tmp_path_factory.mktemp("mixture")
    parts = {}
    for source, (n_train, n_test) in {"math": (12, 8), "language": (8, 4), "code": (6, 3)}.items():
        for split, n in (("train", n_train), ("test", n_test)):
            lines = (STUB_DATA / source / f"{split}.jsonl").read_text().splitlines(keepends=True)[:n]
            (folder / f"{source}_{split}.jsonl").write_text("".join(lines))
        env = folder / f"env_{source}.py"
        env.write_text(GUARD.format(name=source, path=str(ROOT / "environments" / ENVS[source]),
                                    check=CHECKS[source]))
        parts[source] = env
    train = ", ".join(f"{s}: {{path: {folder / f'{s}_train.jsonl'}, weight: {w}}}"
                      for s, w in (("math", 2), ("language", 1), ("code", 1)))
    test = ", ".join(f"{s}: {folder / f'{s}_test.jsonl'}" for s in parts)
    envs = ", ".join(f"{s}: {p}" for s, p in parts.items())
    return [f"data.train_data_path={{{train}}}", f"data.test_data_path={{{test}}}", f"rollout.env_path={{{envs}}}",
            "data.prompts_per_rollout=4", "data.responses_per_prompt=4", "trainer.test_freq=2",
            "trainer.log_samples=100", "rollout.train_sampling_params.max_new_tokens=8",
            "rollout.test_sampling_params.max_new_tokens=8"]


def test_a_mixed_run_routes_rows_logs_each_source_and_resumes_exactly(mixture, tmp_path):
    """Math and language rows scored by exact match, code rows by the sandboxed code env, each behind
    a guard that fails rows of another source: 4 steps on 2 ranks with no env error, per-source
    train and test curves, and 2 + resume + 2 steps equal to 4 straight."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["trainer.total_steps=4", "trainer.save_freq=2", *mixture]
    run_trainer([f"trainer.save_dir={straight}", *common], nproc=2)
    run_trainer([f"trainer.save_dir={resumed}", f"trainer.load_ckpt_from={straight / 'step2'}", *common], nproc=2)
    assert_same(consolidate(str(straight / "step4")), consolidate(str(resumed / "step4")))

    metrics = read_jsonl(straight / "metrics.jsonl")
    assert sum(m.get("env/errors", 0) for m in metrics) == 0  # every row reached its own environment
    seen = {k for m in metrics for k in m}
    for source in ("math", "language", "code"):
        assert f"rewards/test/{source}" in seen
    assert any(k.startswith("rewards/train/") for k in seen) and any(k.startswith("response_length/train/") for k in seen)
    samples = [e for e in read_jsonl(straight / "trajectories.jsonl") if e["type"] == "sample"]
    by_source = Counter(e["source"] for e in samples)
    assert set(by_source) <= {"math", "language", "code"} and by_source["math"] > 0
    for e in samples:  # the source each sample was scored under is the one its prompt came from
        prompt = e["messages"][-2]["content"]
        kind = ("code" if isinstance(e["answer"], dict) else "math" if "+" in prompt else "language")
        assert e["source"] == kind, (e["source"], prompt)
    step4 = {k: v for m in metrics if m["step"] == 4 for k, v in m.items() if k.startswith("rewards/")}
    again = {k: v for m in read_jsonl(resumed / "metrics.jsonl") if m["step"] == 4
             for k, v in m.items() if k.startswith("rewards/")}
    assert step4 == again


def test_shared_instructions_are_not_contamination_but_a_leaked_item_is():
    """The stub code split: every prompt ends with the same instructions (15+ words), which alone
    must not flag the test set; a test problem copied into the training set must."""
    from train.datasets.loading import load_rows

    train = load_rows(str(STUB_DATA / "code" / "train.jsonl"))
    test = load_rows(str(STUB_DATA / "code" / "test.jsonl"))
    assert not check_contamination(train, test).found
    leaked = [*train, {**test[3], "messages": [{"role": "user", "content": "Solve: " + test[3]["messages"][0]["content"]}]}]
    report = check_contamination(leaked, test)
    assert report.exact == [] and report.near == [3]


def test_per_source_curves_are_drawn_with_their_total(tmp_path):
    from train.runtime.logging import test_line
    from train.utils.plot import _parts, plot_metrics, read_metrics

    rows = [{"step": s, "rewards/train": 0.1 * s, "rewards/train/math": 0.2 * s, "rewards/train/code": 0.0,
             "rewards/test": 0.5, "rewards/test/math": 0.7, "rewards/test/code": 0.3} for s in range(1, 4)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert list(_parts(read_metrics(path), "rewards/train")) == ["code", "math"]
    written = {p.name for p in plot_metrics(path, tmp_path / "plots")}
    assert {"summary.png", "rewards_train_math.png", "rewards_test_code.png"} <= written
    assert test_line(rows[0]) == "test reward 0.500 (code 0.300, math 0.700)"
