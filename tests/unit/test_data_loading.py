import csv
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402

from train.datasets import loading  # noqa: E402
from train.datasets.loading import DataError, load_rows  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _rows(n=3):
    return [
        {"messages": [{"role": "user", "content": f"{i}+1=?"}], "answer": str(i + 1), "id": i}
        for i in range(n)
    ]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_csv(path, rows):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if k == "messages" else v for k, v in r.items()})
    return path


def _table(rows):
    # Columns built explicitly so that bad rows (wrong types) can be written too.
    return pa.table({k: [r.get(k) for r in rows] for k in rows[0]})


# --------------------------------------------------------------------------------------- good sources


def test_jsonl(tmp_path):
    rows = load_rows(str(_write_jsonl(tmp_path / "d.jsonl", _rows())))
    assert rows == _rows()


def test_json_list_and_data_key(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_rows()))
    (tmp_path / "b.json").write_text(json.dumps({"data": _rows()}))
    assert load_rows(str(tmp_path / "a.json")) == _rows()
    assert load_rows(str(tmp_path / "b.json")) == _rows()


def test_csv_messages_json_answer_kept_as_text(tmp_path):
    rows = _rows()
    rows[1]["answer"] = "007"
    rows[2]["answer"] = json.dumps(["a", "b"])
    got = load_rows(str(_write_csv(tmp_path / "d.csv", rows)))
    assert got[0]["messages"] == [{"role": "user", "content": "0+1=?"}]
    assert got[0]["answer"] == "1"  # text stays text, not int 1
    assert got[1]["answer"] == "007"
    assert got[2]["answer"] == ["a", "b"]  # a JSON array cell is decoded
    assert got[0]["id"] == "0"  # extra CSV fields are kept as strings


def test_parquet(tmp_path):
    rows = _rows()
    rows[0]["messages"].append({"role": "assistant", "content": "", "tool_calls": [{"name": "calc"}]})
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    got = load_rows(str(path))
    assert got[0]["messages"][1]["tool_calls"] == [{"name": "calc"}]
    # Arrow unifies message structs; the nulls it adds are dropped again.
    assert got[1]["messages"] == [{"role": "user", "content": "1+1=?"}]
    assert [r["answer"] for r in got] == ["1", "2", "3"]


@pytest.mark.parametrize("layout", ["file", "stream"])
def test_arrow_file_and_stream(tmp_path, layout):
    table = pa.Table.from_pylist(_rows())
    path = tmp_path / "d.arrow"
    new = pa.ipc.new_file if layout == "file" else pa.ipc.new_stream
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        writer.write_table(table)
    assert load_rows(str(path)) == _rows()


def test_prompt_convenience_and_null_answer(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": None, "extra": {"k": 1}}])
    (row,) = load_rows(str(path))
    assert row["messages"] == [{"role": "user", "content": "hi"}]
    assert row["answer"] is None and row["extra"] == {"k": 1} and row["prompt"] == "hi"


def test_directory_reads_supported_files_sorted(tmp_path):
    _write_jsonl(tmp_path / "b.jsonl", _rows(2)[1:])
    _write_jsonl(tmp_path / "a.jsonl", _rows(1))
    (tmp_path / "README.md").write_text("not data")
    assert load_rows(str(tmp_path)) == _rows(2)


def test_split_at_save_to_disk_dir(tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(_rows(3)), "test": datasets.Dataset.from_list(_rows(1))}
    )
    dd.save_to_disk(str(tmp_path / "saved"))
    assert load_rows(f"train@{tmp_path / 'saved'}") == _rows(3)
    assert load_rows(f"test@{tmp_path / 'saved'}") == _rows(1)
    with pytest.raises(DataError, match="no split 'valid'"):
        load_rows(f"valid@{tmp_path / 'saved'}")
    with pytest.raises(DataError, match="choose one"):
        load_rows(str(tmp_path / "saved"))
    # A single saved Dataset is loaded from its directory directly.
    datasets.Dataset.from_list(_rows(2)).save_to_disk(str(tmp_path / "single"))
    assert load_rows(str(tmp_path / "single")) == _rows(2)


def test_split_at_local_repo_with_load_dataset(tmp_path, monkeypatch):
    import datasets

    # Keep load_dataset's cache inside tmp_path instead of the user's ~/.cache.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    repo = tmp_path / "repo"
    repo.mkdir()
    _write_jsonl(repo / "train.jsonl", _rows(3))
    rows = load_rows(f"train@{repo}")
    assert [r["answer"] for r in rows] == ["1", "2", "3"]
    assert rows[0]["messages"] == [{"role": "user", "content": "0+1=?"}]


def test_split_at_unknown_repo_fails(tmp_path):
    with pytest.raises(DataError, match="load_dataset"):
        load_rows(f"train@{tmp_path / 'nope'}")


# ------------------------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_rows(str(tmp_path / "x.jsonl"))


def test_unsupported_extension(tmp_path):
    (tmp_path / "d.txt").write_text("hi")
    with pytest.raises(DataError, match=r"d\.txt: unsupported file extension '\.txt'"):
        load_rows(str(tmp_path / "d.txt"))


def test_empty_sources(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="e.jsonl: no rows"):
        load_rows(str(tmp_path / "e.jsonl"))
    (tmp_path / "e.json").write_text("[]")
    with pytest.raises(DataError, match="no rows"):
        load_rows(str(tmp_path / "e.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no"):
        load_rows(str(tmp_path / "empty"))


def test_jsonl_bad_json_line_number(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in _rows(5)]
    lines.insert(1, "")  # blank lines still count in the line numbers
    lines[6 - 1] = '{"messages": [oops'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl: row 6: invalid JSON"):
        load_rows(str(path))


def test_jsonl_wrong_type_message_matches_contract(tmp_path):
    rows = _rows(7)
    rows[6]["messages"] = "hello"
    path = _write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_rows(str(path))
    assert str(e.value) == (
        f"{path}: row 7: field 'messages': expected a non-empty list of {{role, content}} messages, got str"
    )


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"messages": [{"role": "user", "content": "q"}]}, "'answer': missing"),
        ({"answer": 1}, "'messages': missing"),
        ({"messages": [], "answer": 1}, "'messages': expected a non-empty list"),
        ({"messages": [{"role": "bot", "content": "q"}], "answer": 1}, "'messages[0].role'"),
        ({"messages": [{"role": "user", "content": 3}], "answer": 1}, "'messages[0].content': expected str or a list of parts, got int"),
        ({"messages": ["q"], "answer": 1}, "'messages[0]': expected"),
    ],
)
def test_json_bad_rows(tmp_path, bad, field):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(_rows(2) + [bad]))
    with pytest.raises(DataError, match=rf"d\.json: row 3: field {field}".replace("[", r"\[").replace("]", r"\]")):
        load_rows(str(path))


def test_json_invalid(tmp_path):
    (tmp_path / "d.json").write_text('[{"a": 1},\n oops]')
    with pytest.raises(DataError, match=r"d\.json: invalid JSON at line 2"):
        load_rows(str(tmp_path / "d.json"))


def test_json_non_object_row(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps([_rows(1)[0], [1, 2]]))
    with pytest.raises(DataError, match=r"row 2: expected an object"):
        load_rows(str(tmp_path / "d.json"))


def test_csv_bad_rows(tmp_path):
    rows = _rows(3)
    path = _write_csv(tmp_path / "d.csv", rows)
    text = path.read_text().splitlines()
    text[3] = text[3].replace("[{", "[{{", 1)  # line 4 (the header is line 1): broken JSON in the messages cell
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(DataError, match=r"d\.csv: row 4: field 'messages': invalid JSON"):
        load_rows(str(path))
    no_answer = [{k: v for k, v in r.items() if k != "answer"} for r in rows]
    path = _write_csv(tmp_path / "n.csv", no_answer)
    with pytest.raises(DataError, match=r"n\.csv: row 2: field 'answer': missing"):
        load_rows(str(path))


def test_parquet_bad_row(tmp_path):
    rows = _rows(3)
    path = tmp_path / "d.parquet"
    table = pa.table(
        {
            "messages": pa.array([json.dumps(r["messages"]) for r in rows]),  # strings, not message lists
            "answer": [r["answer"] for r in rows],
        }
    )
    pq.write_table(table, path)
    with pytest.raises(DataError, match=r"d\.parquet: row 1: field 'messages': .* got str"):
        load_rows(str(path))


def test_arrow_bad_row_and_missing_field(tmp_path):
    rows = _rows(3)
    rows[2]["messages"] = [{"role": "wizard", "content": "x"}]
    path = tmp_path / "d.arrow"
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match=r"d\.arrow: row 3: field 'messages\[0\]\.role'.*'wizard'"):
        load_rows(str(path))
    table = pa.Table.from_pylist(_rows(2)).drop_columns(["answer"])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match=r"d\.arrow: row 1: field 'answer': missing"):
        load_rows(str(path))


def test_corrupt_parquet_and_arrow(tmp_path):
    for name in ("d.parquet", "d.arrow"):
        (tmp_path / name).write_bytes(b"not a columnar file")
        with pytest.raises(DataError, match=name.replace(".", r"\.") + ": cannot read"):
            load_rows(str(tmp_path / name))


# ------------------------------------------------------------------------------------------ schemes


def test_verifiers_uri_is_routed_and_checked():
    with pytest.raises(DataError, match="verifiers"):
        load_rows("verifiers:nosuchsplit?limit=32")


def test_scheme_registry_is_replaceable(monkeypatch):
    seen = []

    def fake(uri):
        seen.append(uri)
        return [{"prompt": "q", "answer": 1}]

    monkeypatch.setitem(loading.SOURCE_SCHEMES, "verifiers", fake)
    rows = load_rows("verifiers:train?limit=1")
    assert seen == ["verifiers:train?limit=1"]
    assert rows == [{"prompt": "q", "answer": 1, "messages": [{"role": "user", "content": "q"}]}]
    # Rows from a scheme loader go through the same validation.
    monkeypatch.setitem(loading.SOURCE_SCHEMES, "verifiers", lambda uri: [{"prompt": "q"}])
    with pytest.raises(DataError, match=r"verifiers:x: row 1: field 'answer': missing"):
        load_rows("verifiers:x")


@pytest.mark.parametrize("suffix,line", [(".jsonl", 2), (".csv", 3), (".json", 1)])
def test_a_file_that_is_not_utf8_names_its_line(tmp_path, suffix, line):
    path = tmp_path / f"bad{suffix}"
    good = '{"messages": [{"role": "user", "content": "a"}], "answer": "1"}'
    if suffix == ".jsonl":
        data = good.encode() + b'\n{"messages": [{"role": "user", "content": "b\xff"}], "answer": "2"}\n'
    elif suffix == ".csv":
        data = b"prompt,answer\nok,1\nb\xff,2\n"
    else:
        data = b'[{"messages": [{"role": "user", "content": "\xfe"}], "answer": "1"}]'
    path.write_bytes(data)
    with pytest.raises(DataError, match=rf"{path}: line {line} \(byte \d+\) is not UTF-8"):
        load_rows(str(path))


def test_a_limit_reads_only_the_first_rows_of_every_format(tmp_path):
    """load_rows(source, limit): the pre-flight check's bounded read. JSONL and CSV stop reading at the
    limit (a broken line after it is never seen), Parquet reads one batch, Arrow and JSON slice; a
    folder counts across its files."""
    rows = _rows(10)
    jsonl = _write_jsonl(tmp_path / "a.jsonl", rows)
    jsonl.write_text(jsonl.read_text() + "{not json\n")
    assert load_rows(str(jsonl), limit=4) == rows[:4]
    with pytest.raises(DataError, match="row 11: invalid JSON"):
        load_rows(str(jsonl))
    csv_path = _write_csv(tmp_path / "b.csv", rows)
    csv_path.write_text(csv_path.read_text() + "1,2,3,4,5,6\n")  # more cells than columns, after the limit
    assert [r["id"] for r in load_rows(str(csv_path), limit=3)] == ["0", "1", "2"]
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=2)
    assert load_rows(str(parquet), limit=5) == rows[:5]
    arrow = tmp_path / "d.arrow"
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert load_rows(str(arrow), limit=2) == rows[:2]
    (tmp_path / "e.json").write_text(json.dumps(rows))
    assert load_rows(str(tmp_path / "e.json"), limit=1) == rows[:1]
    folder = tmp_path / "folder"
    folder.mkdir()
    _write_jsonl(folder / "1.jsonl", rows[:3])
    _write_jsonl(folder / "2.jsonl", rows[3:])
    (folder / "3.jsonl").write_text("{not json\n")  # never opened
    got = load_rows(str(folder), limit=5)
    assert got == rows[:5] and [r.where for r in got][3:] == [f"{folder / '2.jsonl'}: row {n}" for n in (1, 2)]
