"""A full or read-only disk said in words: writes that fail for lack of space become one DiskFullError
naming the path, what was being written and the space left, instead of torch's `enforce fail at
inline_container.cc` or a DCP traceback; writes refused by the filesystem (read-only, permission
denied) become one UnwritableError naming the path, what was being written and what to do."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator

MB = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# torch.save's writer drops the errno ("[enforce fail at inline_container.cc:672] . unexpected pos ...");
# when its message looks like this, the filesystem is asked how much space is left.
_OPAQUE_WRITE_FAILURES = ("inline_container.cc", "file write failed")
NEARLY_FULL_BYTES = 16 * MB
# A folder that refuses writes: a read-only mount (EROFS) or one this user may not write (EACCES, EPERM).
UNWRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class StorageError(RuntimeError):
    """A write under the run folder failed for a reason of the disk's, said in one line."""


class DiskFullError(StorageError):
    """A write failed because the disk (or quota) is full."""


class UnwritableError(StorageError):
    """A write failed because the filesystem refuses it (read-only, permission denied)."""


def unwritable(exc: BaseException) -> OSError | None:
    """The OSError in `exc`'s chain that says a path cannot be written (read-only, no permission), or None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in UNWRITABLE_ERRNOS:
            return e
    return None


def unwritable_line(e: OSError, what: str, path: str, advice: str = "") -> str:
    """One line for a write refused by the filesystem: the path, what was written, what to do."""
    target = e.filename or path
    return (f"cannot write {what} ({target}): {e.strerror or e} (errno {errno.errorcode.get(e.errno, e.errno)}): "
            f"point trainer.save_dir at a writable folder{'; ' + advice if advice else ''}")


def is_under(path: str | None, folder: str) -> bool:
    """Whether `path` is `folder` or inside it."""
    if not path or not folder:
        return False
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent), or None."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        todo += [x for x in getattr(e, "failures", {}).values() if isinstance(x, BaseException)]  # DCP's per-rank errors


def is_disk_full(exc: BaseException, path: str) -> bool:
    """Whether `exc` (or what caused it) is a write that failed for lack of space under `path`."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        if any(marker in text for marker in _OPAQUE_WRITE_FAILURES):
            free = free_bytes(path)
            return free is not None and free < NEARLY_FULL_BYTES
    return False


@contextlib.contextmanager
def explain_disk_full(what: str, path: str, advice: str = "") -> Iterator[None]:
    """Re-raise a failed write under `path` as DiskFullError when the disk is full, as UnwritableError
    when the filesystem refuses it (read-only, permission denied); else as it was."""
    try:
        yield
    except BaseException as e:
        if not is_disk_full(e, path):
            refused = unwritable(e)
            if refused is None:
                raise
            raise UnwritableError(unwritable_line(refused, what, path, advice)) from e
        free = free_bytes(path)
        left = f"{free / MB:.1f} MiB free" if free is not None else "free space unknown"
        raise DiskFullError(f"no space left on the device holding {path} while writing {what} ({left}): free some "
                            f"space or point trainer.save_dir at a larger disk{'; ' + advice if advice else ''}") from e
