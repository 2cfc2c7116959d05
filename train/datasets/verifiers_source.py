"""Rows from a verifiers taskset (`verifiers:train?limit=32`).

Placeholder: the real loader needs the verifiers adapter (environments/verifiers_adapter.py). It is
reached through `train.datasets.loading.SOURCE_SCHEMES["verifiers"]`, which imports this module lazily.
"""

from __future__ import annotations

from train.datasets.loading import DataError


def load_verifiers_rows(uri: str) -> list[dict]:
    """Return the rows of the verifiers taskset named by ``uri`` (the full ``verifiers:...`` source)."""
    raise DataError(
        "verifiers: data sources need the verifiers adapter (environments/verifiers_adapter.py), "
        "which is not available yet"
    )
