"""Load prompt rows from files, Hugging Face datasets and scheme-prefixed sources.

The data contract: every row is a dict with

* ``messages``: a non-empty list of ``{"role": ..., "content": str}`` dicts, ``role`` one of
  ``system``/``user``/``assistant``/``tool``; extra message keys (``tool_calls``, ``name``, ...)
  are kept. ``content`` may also be a list of parts: ``{"type": "text", "text": ...}`` and images
  (``{"type": "image", "image" | "path" | "url": ...}`` or ``{"type": "image_url", "image_url": {"url": ...}}``,
  a file path or a ``data:`` URL; train/datasets/vision.py). A relative image path in a file is read
  from that file's folder.
* ``answer``: any JSON value (``null`` included), but the key must be present, so a typo in a column
  name fails at load time instead of scoring every sample against ``None``.
* any other fields, kept as they are (environments may read them).

Conveniences (the row keeps its original ``prompt`` field too):

* ``"prompt": "text"`` with no ``messages`` becomes ``messages=[{"role": "user", "content": text}]``.
* ``"prompt": [messages...]`` (TRL's conversational format) with no ``messages`` is used as the messages.

Sources accepted by :func:`load_rows`:

* a file: ``.json`` (a list of rows or ``{"data": [...]}``), ``.jsonl``, ``.csv`` (``messages`` holds
  a JSON string; ``answer`` is kept as the cell's text unless it is a JSON object, array or quoted
  string), ``.parquet``, ``.arrow`` (Arrow IPC file or stream);
* a ``datasets`` ``save_to_disk`` directory of a single ``Dataset``;
* any other directory: every supported file directly inside it, in sorted name order;
* ``split@repo``: ``datasets.load_dataset(repo, split=split)`` (a local path, or a name already in
  the local HF cache when offline); ``split@dir`` where ``dir`` is a ``save_to_disk`` directory of a
  ``DatasetDict`` reads ``load_from_disk(dir)[split]``;
* ``scheme:rest`` for a scheme in :data:`SOURCE_SCHEMES` (``verifiers:train?limit=32``).

Every problem raises :class:`DataError` naming the source, the row and the field. Rows are numbered from
1, the same way in every message (this module's, the mixture's routing check): in JSONL and CSV files by
the line they start on (a CSV's header is line 1), elsewhere by their position. Each loaded row is a
:class:`Row` whose ``where`` says so (``"data/train.jsonl: row 2"``) for checks made after loading.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Callable

from train.datasets.errors import DataError

__all__ = ["DataError", "Row", "SOURCE_SCHEMES", "load_rows"]

ROLES = ("system", "user", "assistant", "tool")
SUPPORTED_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet", ".arrow")


def _load_verifiers(uri: str) -> list[dict]:
    # Imported lazily so that loading plain files never imports the verifiers stack.
    from train.datasets.verifiers_source import load_verifiers_rows

    return load_verifiers_rows(uri)


# Scheme -> loader taking the full source string. Rows it returns are validated like file rows.
# New schemes (or a new verifiers loader) plug in here without touching load_rows.
SOURCE_SCHEMES: dict[str, Callable[[str], list[dict]]] = {
    "verifiers": _load_verifiers,
}


def load_rows(source: str, limit: int | None = None) -> list[dict]:
    """Load and validate the rows of ``source`` (see the module docstring for what it may be).
    ``limit``: at most that many rows, the first ones (JSONL, CSV and Parquet files stop reading
    there; JSON is parsed whole); what lies beyond them is neither read nor checked."""
    source = str(source)
    if limit is not None and limit < 1:
        raise ValueError(f"load_rows: limit must be >= 1 or None, got {limit}")
    scheme = source.split(":", 1)[0] if ":" in source else None
    if scheme in SOURCE_SCHEMES and not os.path.exists(source):
        return _validate_all(SOURCE_SCHEMES[scheme](source), source, limit)

    path = Path(source)
    if path.exists():
        return _load_path(path, limit)
    if "@" in source:
        split, repo = source.split("@", 1)
        if split and repo:
            return _load_split(split, repo, source, limit)
    raise DataError(
        f"{source}: no such file or directory (expected a .json/.jsonl/.csv/.parquet/.arrow file, a "
        f"directory, 'split@repo_or_dir', or one of the schemes {sorted(SOURCE_SCHEMES)} as 'scheme:...')"
    )


# ---------------------------------------------------------------------------------------------- paths


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _is_saved_dataset_dict(path: Path) -> bool:
    return path.is_dir() and (path / "dataset_dict.json").is_file()


def _load_path(path: Path, limit: int | None) -> list[dict]:
    if path.is_dir():
        if _is_saved_dataset(path):
            return _validate_all(_read_saved_dataset(path, None, limit), str(path), limit)
        if _is_saved_dataset_dict(path):
            raise DataError(
                f"{path}: a saved DatasetDict holds several splits; choose one as 'SPLIT@{path}' "
                f"(splits: {', '.join(_saved_splits(path)) or 'none'})"
            )
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUPPORTED_EXTENSIONS)
        if not files:
            raise DataError(f"{path}: directory holds no {'/'.join(SUPPORTED_EXTENSIONS)} files")
        rows: list[dict] = []
        for f in files:
            if limit is not None and len(rows) >= limit:
                break
            rows.extend(_load_file(f, None if limit is None else limit - len(rows)))
        return rows
    return _load_file(path, limit)


def _load_file(path: Path, limit: int | None = None) -> list[dict]:
    readers: dict[str, Callable[[Path, int | None], list[dict]]] = {
        ".json": _read_json,
        ".jsonl": _read_jsonl,
        ".csv": _read_csv,
        ".parquet": _read_parquet,
        ".arrow": _read_arrow,
    }
    reader = readers.get(path.suffix)
    if reader is None:
        raise DataError(
            f"{path}: unsupported file extension {path.suffix!r} (supported: {', '.join(SUPPORTED_EXTENSIONS)})"
        )
    try:
        rows = reader(path, limit)
    except UnicodeDecodeError as e:
        raise _not_utf8(path) from e
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _not_utf8(path: Path) -> DataError:
    """Where a text file stops being UTF-8: its line (a JSONL row) and byte."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return DataError(f"{path}: line {line} (byte {e.start}) is not UTF-8 ({e.reason}); save the file as UTF-8")
    return DataError(f"{path}: not UTF-8; save the file as UTF-8")


def _read_json(path: Path, limit: int | None) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if isinstance(data, dict) and "data" in data:
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of rows or {{\"data\": [...]}}, got {type(data).__name__}")
    return [_validate_row(row, str(path), i) for i, row in enumerate(data[:limit], start=1)]


def _read_jsonl(path: Path, limit: int | None) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) are not rows
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: row {lineno}: invalid JSON: {e.msg} (column {e.colno})") from e
            rows.append(_validate_row(row, str(path), lineno))
    return rows


def _read_csv(path: Path, limit: int | None) -> list[dict]:
    # The stdlib reader keeps every cell a string (pandas would turn "007" into 7 and "" into NaN).
    rows = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        end = 1  # the header's last line
        for raw in reader:
            if limit is not None and len(rows) >= limit:
                break
            i, end = end + 1, reader.line_num  # the line the row starts on (a quoted cell may span lines)
            row: dict[str, Any] = dict(raw)
            if None in row:
                raise DataError(f"{path}: row {i}: more cells than header columns")
            if isinstance(row.get("messages"), str):
                try:
                    row["messages"] = json.loads(row["messages"])
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: row {i}: field 'messages': invalid JSON: {e.msg}") from e
            if isinstance(row.get("prompt"), str) and row["prompt"].lstrip().startswith("[") and "messages" not in row:
                row["prompt"] = _maybe_json(row["prompt"])
            if isinstance(row.get("answer"), str):
                row["answer"] = _maybe_json(row["answer"])
            rows.append(_validate_row(row, str(path), i))
    return rows


def _maybe_json(text: str) -> Any:
    # Only containers and quoted strings are decoded: "42" stays the string "42", as in a JSONL row
    # that wrote the answer as text, instead of silently becoming an int.
    if text.lstrip()[:1] in ("[", "{", '"'):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    return text


def _read_parquet(path: Path, limit: int | None) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if limit is None:
            table = pq.read_table(path)
        else:  # the first batch only: a large file is not read whole
            parquet = pq.ParquetFile(path)
            batch = next(parquet.iter_batches(batch_size=limit), None)
            table = pa.Table.from_batches([batch]) if batch is not None else parquet.schema_arrow.empty_table()
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read as Parquet: {e}") from e
    return [_validate_row(row, str(path), i) for i, row in enumerate(table.to_pylist(), start=1)]


def _read_arrow(path: Path, limit: int | None) -> list[dict]:
    import pyarrow as pa

    # Arrow has two IPC layouts: the random-access "file" format (with footer) and the "stream"
    # format that `datasets` writes; accept both.
    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
    except Exception:
        try:
            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except Exception as e:
            raise DataError(f"{path}: cannot read as an Arrow IPC file or stream: {e}") from e
    if limit is not None:
        table = table.slice(0, limit)  # memory-mapped: only these rows become Python objects
    return [_validate_row(row, str(path), i) for i, row in enumerate(table.to_pylist(), start=1)]


# --------------------------------------------------------------------------------- HF `datasets`


def _saved_splits(path: Path) -> list[str]:
    try:
        return list(json.loads((path / "dataset_dict.json").read_text())["splits"])
    except Exception:
        return []


def _read_saved_dataset(path: Path, split: str | None, limit: int | None = None) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: cannot load with datasets.load_from_disk: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            raise DataError(f"{path}: a saved DatasetDict; choose a split as 'SPLIT@{path}'")
        if split not in ds:
            raise DataError(f"{split}@{path}: no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    elif split is not None:
        raise DataError(f"{split}@{path}: a saved single Dataset has no splits; pass the directory itself")
    return _first_rows(ds, limit)


def _first_rows(ds, limit: int | None) -> list[dict]:
    """A `datasets.Dataset`'s rows as dicts, the first `limit` only when given (memory-mapped: the rest stay on disk)."""
    if limit is not None and len(ds) > limit:
        ds = ds.select(range(limit))
    return ds.to_list()


def _load_split(split: str, repo: str, source: str, limit: int | None = None) -> list[dict]:
    repo_path = Path(repo)
    if _is_saved_dataset_dict(repo_path) or _is_saved_dataset(repo_path):
        rows = _read_saved_dataset(repo_path, split, limit)
    else:
        import datasets

        try:
            ds = datasets.load_dataset(repo, split=split)
        except Exception as e:  # network, missing cache, bad split: all mean "cannot load this source"
            raise DataError(f"{source}: datasets.load_dataset({repo!r}, split={split!r}) failed: {e}") from e
        rows = _first_rows(ds, limit)
    return _validate_all(rows, source, limit)


# ---------------------------------------------------------------------------------------- validation


def _validate_all(rows: Any, label: str, limit: int | None = None) -> list[dict]:
    if not isinstance(rows, list):
        raise DataError(f"{label}: expected a list of rows, got {type(rows).__name__}")
    if not rows:
        raise DataError(f"{label}: no rows")
    return [_validate_row(row, label, i) for i, row in enumerate(rows[:limit], start=1)]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class Row(dict):
    """A loaded row: a plain dict of its fields, plus `where` it came from ("<source>: row N")."""
    where: str | None = None


def _validate_row(row: Any, label: str, index: int) -> dict:
    """Check one row against the contract; return it with ``messages`` normalised."""
    where = f"{label}: row {index}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with 'messages' and 'answer', got {_type_name(row)}")
    row = Row(row)
    row.where = where
    if "messages" not in row or row["messages"] is None:
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            row["messages"] = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            row["messages"] = prompt
        else:
            raise DataError(f"{where}: field 'messages': missing (give 'messages' or a 'prompt' string)")
    base = os.path.dirname(label) if os.path.isfile(label) else None  # relative image paths: the file's folder
    row["messages"] = _validate_messages(row["messages"], where, base)
    if "answer" not in row:
        raise DataError(f"{where}: field 'answer': missing (use \"answer\": null when there is none)")
    return row


PART_TYPES = ("text", "image", "image_url")


def _validate_parts(parts: list, where: str, field: str, base: str | None) -> list[dict]:
    """A message's list content: text and image parts (nulls of columnar formats dropped), relative image
    paths made absolute against `base`."""
    out = []
    for k, part in enumerate(parts):
        at = f"{field}.content[{k}]"
        if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
            got = part.get("type") if isinstance(part, dict) else _type_name(part)
            raise DataError(f"{where}: field '{at}': expected a part of type {', '.join(PART_TYPES)}, got {got!r}")
        part = {key: value for key, value in part.items() if value is not None}
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise DataError(f"{where}: field '{at}.text': expected str, got {_type_name(part.get('text'))}")
        if part["type"] == "image":
            key = next((key for key in ("image", "path", "url") if key in part), None)
            if key is None or not isinstance(part[key], str):
                raise DataError(f"{where}: field '{at}': an image part needs 'image', 'path' or 'url' holding a file "
                                "path or a data: URL")
            if base is not None and not part[key].startswith(("data:", "/", "http://", "https://")):
                part[key] = os.path.join(base, part[key])
        if part["type"] == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise DataError(f"{where}: field '{at}.image_url.url': expected a data: URL or a file path")
        out.append(part)
    return out


def _validate_messages(messages: Any, where: str, base: str | None = None) -> list[dict]:
    expected = "expected a non-empty list of {role, content} messages"
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else _type_name(messages)
        raise DataError(f"{where}: field 'messages': {expected}, got {got}")
    out = []
    for j, msg in enumerate(messages):
        field = f"messages[{j}]"
        if not isinstance(msg, dict):
            raise DataError(f"{where}: field '{field}': {expected}, got {_type_name(msg)}")
        if msg.get("role") not in ROLES:
            raise DataError(f"{where}: field '{field}.role': expected one of {', '.join(ROLES)}, got {msg.get('role')!r}")
        if isinstance(msg.get("content"), list):
            msg = {**msg, "content": _validate_parts(msg["content"], where, field, base)}
        elif not isinstance(msg.get("content"), str):
            raise DataError(f"{where}: field '{field}.content': expected str or a list of parts, got "
                            f"{_type_name(msg.get('content'))}")
        # Columnar formats (Parquet, Arrow, datasets) unify message structs, so a message without
        # `tool_calls` comes back with `tool_calls: None`; drop such nulls so chat templates see the
        # same messages as from JSON.
        out.append({k: v for k, v in msg.items() if v is not None or k in ("role", "content")})
    return out
