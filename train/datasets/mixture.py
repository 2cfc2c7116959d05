"""Training and test data from one source or a mixture of named sources.

`data.train_data_path` (and `data.test_data_path`) is one of

* a source string (a file, a directory, `split@repo`, `verifiers:...`; see loading.py): today's single
  unnamed source; rows that carry a `source` field are still counted per source;
* a list of source strings: each named by its file name without extension (`math/train.jsonl` and
  `code/train.jsonl` would both be `train`, so name them with a mapping instead);
* a mapping `name: source` or `name: {path: source, weight: w}`.

In a list or mapping, every row's `source` field is set to its entry's name (a `source` field the
file had is replaced): that name routes the row to its environment (`rollout.env_path` as a mapping)
and names its metrics (`rewards/train/<name>`).

Weights (all entries or none, each > 0) set each source's share of the training stream: an epoch
holds as many rows as all sources together, source s filling a share w_s / sum(w) of it, cycling
through its own rows (a small source with a large weight repeats within an epoch, a large one with
a small weight takes several epochs to be seen whole). Without weights an epoch is one pass over
every row, as for a single source. Test sets are evaluated whole, so they take no weight.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from train.datasets.errors import DataError
from train.datasets.loading import load_rows


class MixtureError(ValueError):
    """A badly formed source list or mapping; the message names the config key."""


@dataclass(frozen=True)
class Source:
    name: str | None  # None: the single source of a plain `data.train_data_path: path`
    path: str
    weight: float | None = None


def _key_error(key: str, problem: str) -> MixtureError:
    return MixtureError(f"config key '{key}': {problem}")


def parse_sources(value: Any, key: str, *, weights: bool = True) -> list[Source]:
    """The sources `key` names (see the module docstring); `weights=False` refuses weights (test sets)."""
    if isinstance(value, str):
        return [Source(None, value)]
    if isinstance(value, Mapping):
        if not value:
            raise _key_error(key, "an empty mapping; give at least one 'name: path'")
        sources = [_entry(str(name), spec, f"{key}.{name}", weights) for name, spec in value.items()]
    elif isinstance(value, Sequence):
        if not value:
            raise _key_error(key, "an empty list; give at least one path")
        sources = []
        for i, path in enumerate(value):
            if not isinstance(path, str):
                raise _key_error(f"{key}[{i}]", f"expected a path string, got {type(path).__name__} (a "
                                                f"mapping 'name: {{path: ..., weight: ...}}' takes weights)")
            sources.append(Source(os.path.splitext(os.path.basename(path.rstrip("/")))[0], path))
        names = [s.name for s in sources]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise _key_error(key, f"several paths are named {', '.join(map(repr, twice))} (sources in a list are "
                                  f"named by file name); use a mapping such as {{math: a/train.jsonl, code: "
                                  f"b/train.jsonl}}")
    else:
        raise _key_error(key, f"expected a path, a list of paths or a mapping name -> path, got {type(value).__name__}")
    given = [s.weight is not None for s in sources]
    if any(given) and not all(given):
        missing = [s.name for s in sources if s.weight is None]
        raise _key_error(key, f"weights are given for some sources but not for {', '.join(missing)}; give every "
                              f"source a weight or none")
    return sources


def _entry(name: str, spec: Any, key: str, weights: bool) -> Source:
    if isinstance(spec, str):
        return Source(name, spec)
    if not isinstance(spec, Mapping):
        raise _key_error(key, f"expected a path or {{path: ..., weight: ...}}, got {type(spec).__name__}")
    unknown = sorted(set(spec) - {"path", "weight"})
    if unknown:
        raise _key_error(key, f"unknown field(s) {', '.join(map(str, unknown))} (a source takes path and weight)")
    path = spec.get("path")
    if not isinstance(path, str):
        raise _key_error(f"{key}.path", f"expected a path string, got {path!r}")
    weight = spec.get("weight")
    if weight is None:
        return Source(name, path)
    if not weights:
        raise _key_error(f"{key}.weight", "test sets are evaluated whole; weights apply to data.train_data_path only")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise _key_error(f"{key}.weight", f"must be a number > 0, got {weight!r}")
    return Source(name, path, float(weight))


def load_sources(sources: list[Source], limit: int | None = None) -> list[dict]:
    """Every source's rows in order, each named source's rows tagged with `source`; with `limit`,
    only the first `limit` rows of each (the pre-flight check's bounded read)."""
    rows: list[dict] = []
    for source in sources:
        part = load_rows(source.path, limit)
        if source.name is not None:
            for row in part:
                row["source"] = source.name
        rows += part
    return rows


def mixture_shares(sources: list[Source], rows: list[dict]) -> dict[str, list[int]]:
    """The data loader's `sizes` (rows of each source, in load order) and `shares` (rows each source
    fills per epoch: proportional to the weights, each at least 1, all together about as many as
    there are rows) for a weighted mixture; {} without weights (an epoch is one pass over every row)."""
    if not sources or sources[0].weight is None:
        return {}
    sizes = [sum(1 for row in rows if row.get("source") == s.name) for s in sources]
    total, weight_sum = sum(sizes), sum(s.weight for s in sources)
    return {"sizes": sizes, "shares": [max(1, round(total * s.weight / weight_sum)) for s in sources]}


def source_names(rows: list[dict]) -> list[str]:
    """The distinct `source` values of `rows`, sorted: the per-source metrics' names."""
    return sorted({str(row["source"]) for row in rows if row.get("source") is not None})


def check_routes(rows: list[dict], routed: Mapping[str, Any], label: str) -> None:
    """With `rollout.env_path` as a mapping, every row's source must have an environment. A row is
    named as its loader numbered it (`<file>: row N`, loading.py), so both checks point at one line."""
    for i, row in enumerate(rows):
        where = f"{label}: {getattr(row, 'where', None) or f'row {i + 1}'}"
        source = row.get("source")
        if source is None:
            raise DataError(f"{where}: field 'source': missing, but rollout.env_path is a mapping "
                            f"({', '.join(routed)}) that routes rows by source; name the sources in "
                            f"{label.split(' ')[0]} as a mapping, or give every row a 'source'")
        if str(source) not in routed:
            raise DataError(f"{where}: field 'source': {source!r} has no environment in rollout.env_path "
                            f"(sources with one: {', '.join(routed)}); add 'rollout.env_path.{source}'")
