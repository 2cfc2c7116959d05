"""Model names to local folders: a folder on disk, or a Hugging Face Hub id resolved through
`huggingface_hub` and its cache.

- A name that exists on disk is used as is.
- Otherwise a name shaped like a Hub id (`org/name` or `name`) is looked up in the Hugging Face
  cache (`HF_HOME` / `HF_HUB_CACHE`) and, unless `HF_HUB_OFFLINE=1`, downloaded into it (with
  `HF_TOKEN` for gated or private repositories). Only what loading needs is fetched: configs,
  tokenizer files and safetensors weights (`.bin` weights only when a repository has no safetensors).
- Rate limits (HTTP 429, honouring `Retry-After`) and transient failures (5xx, connection errors,
  timeouts) are retried with exponential backoff; a missing repository, a gated one without a
  token, or an uncached id while offline fail at once with a message that names the id and what
  to do.

`resolve_on_node` makes each node fetch once: local rank 0 downloads, the node's other ranks then
read the same cache without network access.
"""
from __future__ import annotations

import datetime
import os
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# Files a model folder needs to load: configs, tokenizer, chat template, safetensors weights.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
TOKENIZER_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
FALLBACK_WEIGHTS = ["*.bin"]  # old repositories without safetensors

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelNotFound(ValueError):
    """A model name that is neither a local folder nor obtainable from the Hub; says what to do."""


def is_offline() -> bool:
    """HF_HUB_OFFLINE as set now, or as huggingface_hub read it when first imported."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def looks_like_repo_id(name: str) -> bool:
    """`org/name` or `name` (no leading `/`, `.`, `~`, no backslash): what the Hub accepts."""
    return bool(REPO_ID.match(name)) and ".." not in name and not name.endswith((".", "-"))


def export_name(name: str, folder: str) -> str:
    """How an exported LoRA adapter names its base model: the Hub id the run named (portable), or the
    absolute path of the local folder it loaded."""
    return os.path.abspath(folder) if os.path.exists(name) else name


def cache_dir() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6  # tries in all
    base_delay_s: float = 2.0  # doubled after each failure, with jitter
    max_delay_s: float = 60.0


def _root(error: BaseException) -> BaseException:
    """The HTTP error behind a wrapped one (snapshot_download's LocalEntryNotFoundError)."""
    while getattr(error, "response", None) is None and error.__cause__ is not None:
        error = error.__cause__
    return error


def _status(error: BaseException) -> int | None:
    response = getattr(_root(error), "response", None)
    return getattr(response, "status_code", None)


def _retry_after(error: BaseException) -> float | None:
    response = getattr(_root(error), "response", None)
    headers = getattr(response, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def is_transient(error: BaseException) -> bool:
    """Worth another try: rate limits, server errors, connection problems and timeouts."""
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if isinstance(error, LocalEntryNotFoundError):
        # snapshot_download reports a Hub it could not reach as "not in the cache", the cause attached
        cause = error.__cause__
        return cause is not None and type(cause).__name__ != "OfflineModeIsEnabled" and is_transient(cause)
    if isinstance(error, (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError)):
        return False
    status = _status(error)
    if status is not None:
        return status == 429 or status >= 500
    name = type(error).__name__
    return isinstance(error, (ConnectionError, TimeoutError)) or any(
        word in name for word in ("Connect", "Timeout", "Network", "Transport", "Protocol", "ReadError"))


def with_backoff(fetch: Callable[[], str], what: str, policy: RetryPolicy = RetryPolicy(),
                 sleep: Callable[[float], None] = time.sleep) -> str:
    """`fetch()`, retried on transient errors with exponential backoff (and `Retry-After`)."""
    delay = policy.base_delay_s
    for attempt in range(1, policy.attempts + 1):
        try:
            return fetch()
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e) or attempt == policy.attempts:
                if is_transient(e):
                    raise ModelNotFound(f"{what}: download failed after {attempt} attempts "
                                        f"({type(e).__name__}: {e}); check the network or try again later") from e
                raise
            wait = _retry_after(e) if _status(e) == 429 else None
            wait = min(policy.max_delay_s, wait if wait is not None else delay * (1 + 0.25 * random.random()))
            print(f"{what}: {type(e).__name__} ({_status(e) or 'no status'}), retry {attempt}/{policy.attempts - 1} "
                  f"in {wait:.1f} s", flush=True)
            sleep(wait)
            delay = min(policy.max_delay_s, delay * 2)
    raise AssertionError("unreachable")


def _has_weights(folder: str) -> bool:
    return any(f.endswith(".safetensors") for f in os.listdir(folder))


def resolve(name: str, kind: str = "model", *, local_files_only: bool | None = None,
            policy: RetryPolicy = RetryPolicy(), sleep: Callable[[float], None] = time.sleep,
            download: Callable[..., str] | None = None) -> str:
    """A local folder for `name` (see the module docstring). `kind` is "model" (weights too) or
    "tokenizer". Raises ModelNotFound with what to do."""
    if os.path.exists(name):
        return name
    if not looks_like_repo_id(name):
        raise ModelNotFound(f"path '{name}' does not exist (relative paths are from {os.getcwd()})")
    if download is None:
        from huggingface_hub import snapshot_download as download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = is_offline() if local_files_only is None else local_files_only
    patterns = MODEL_FILES if kind == "model" else TOKENIZER_FILES
    token = os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's own lookup (saved login)

    def fetch(allow: list[str]) -> str:
        return with_backoff(lambda: download(name, allow_patterns=allow, local_files_only=offline, token=token,
                                             cache_dir=cache_dir(), endpoint=os.environ.get("HF_ENDPOINT") or None),
                            f"'{name}'", policy, sleep)

    try:
        folder = fetch(patterns)
        if kind == "model" and not _has_weights(folder):
            folder = fetch(patterns + FALLBACK_WEIGHTS)
    except LocalEntryNotFoundError:
        where = f"the Hugging Face cache ({cache_dir()})"
        if offline:
            raise ModelNotFound(
                f"'{name}' is not a local folder (relative to {os.getcwd()}) and not in {where}, and downloads "
                f"are off (HF_HUB_OFFLINE=1): download it once online (`hf download {name}`), point HF_HOME or "
                f"HF_HUB_CACHE at a cache that holds it, or give a local folder") from None
        raise ModelNotFound(f"'{name}' is not in {where} and the Hub cannot be reached: check the network, "
                            f"or download it elsewhere and point HF_HUB_CACHE at that cache") from None
    except GatedRepoError:
        raise ModelNotFound(f"'{name}' is gated on the Hugging Face Hub: accept its licence on the model page "
                            f"and set HF_TOKEN to a token with access") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"'{name}' is not a local folder (relative to {os.getcwd()}) and no such model exists "
                            f"on the Hugging Face Hub (or it is private: set HF_TOKEN)") from None
    return folder


def resolve_all(names: Mapping[str, tuple[str, str]], **kw) -> dict[str, str]:
    """{key: (name, kind)} -> {key: folder}; a ModelNotFound message is prefixed with its key."""
    out = {}
    for key, (name, kind) in names.items():
        try:
            out[key] = resolve(name, kind, **kw)
        except ModelNotFound as e:
            raise ModelNotFound(f"config key '{key}': {e}") from None
    return out


def resolve_on_node(names: Mapping[str, tuple[str, str]], local_rank: int, timeout_s: float) -> dict[str, str]:
    """`resolve_all`, with one download per node: local rank 0 of each node fetches (or finds an
    error), every rank learns the outcome through a CPU collective that waits at most `timeout_s`,
    then the other local ranks read the now-filled cache offline. Every rank raises the same error."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return resolve_all(names)
    # Every rank takes part whatever its file system shows (paths may exist on some nodes only).
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    outcome: str | None = None
    resolved: dict[str, str] = {}
    if local_rank == 0:
        try:
            resolved = resolve_all(names)
        except ModelNotFound as e:
            outcome = str(e)
    gathered: list[str | None] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, outcome, group=group)
    except RuntimeError as e:
        fetched = ", ".join(n for n, _ in names.values())
        raise ModelNotFound(f"waited {timeout_s:g} s (trainer.model_fetch_timeout_s) for local rank 0 of every "
                            f"node to fetch {fetched}: {e}") from None
    finally:
        dist.destroy_process_group(group)
    errors = [e for e in gathered if e]
    if errors:
        raise ModelNotFound(errors[0])
    return resolved if local_rank == 0 else resolve_all(names, local_files_only=True)


def add_to_cache(folder: str, repo_id: str, cache: str | None = None) -> str:
    """Place a local model folder into a Hugging Face cache under `repo_id`, in the Hub's own layout
    (`models--org--name/{blobs,refs/main,snapshots/<commit>}`), so that the id resolves offline:
    for air-gapped clusters, and for tests. Returns the snapshot folder."""
    import hashlib
    import shutil

    cache = cache or cache_dir()
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    files = sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))
    digest = hashlib.sha1()
    blobs = {}
    for name in files:
        with open(os.path.join(folder, name), "rb") as f:
            blob = hashlib.sha256(f.read()).hexdigest()
        blobs[name] = blob
        digest.update(f"{name}:{blob}".encode())
    commit = digest.hexdigest()
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for name, blob in blobs.items():
        target = os.path.join(repo, "blobs", blob)
        if not os.path.exists(target):
            shutil.copyfile(os.path.join(folder, name), target)
        link = os.path.join(snapshot, name)
        if not os.path.lexists(link):
            os.symlink(os.path.relpath(target, snapshot), link)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    return snapshot


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Put a local model folder into the Hugging Face cache under a Hub "
                                     "id, so that `actor.model_name=<id>` works offline.")
    parser.add_argument("folder")
    parser.add_argument("repo_id")
    parser.add_argument("--cache", default=None, help="cache folder (default: HF_HUB_CACHE / HF_HOME/hub)")
    args = parser.parse_args()
    print(add_to_cache(args.folder, args.repo_id, args.cache))
