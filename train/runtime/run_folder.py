"""A run folder (`trainer.save_dir`) belongs to one run.

Starting without `trainer.load_ckpt_from` in a folder that already holds a run (its `run.json`,
checkpoints, metrics or export) is refused with one line that says what to do; `trainer.overwrite=true`
moves the old run aside to `<save_dir>.replaced-<time>` (never deletes it) and starts over. Rank 0
holds an exclusive `flock` on `<save_dir>/.lock` for the run's life, so two live runs cannot share a
folder (the kernel releases it when the process dies: no stale locks). `run.json` keeps the run id
and one entry per start (fresh or resumed). A folder the filesystem will not let the run write
(read-only, permission denied, a file in its place) is one RunFolderError naming the path and what to do.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import uuid

from train.parallel.collectives import broadcast_from_main
from train.parallel.distributed import DistContext

LOCK = ".lock"
RUN_FILE = "run.json"
# A folder this run cannot write: read-only, not the user's, or a file where a folder should be.
REFUSED_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST)


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (held by another run, or in use by a live one)."""


def holds_a_run(save_dir: str) -> bool:
    """Whether `save_dir` has anything a run writes: run.json, checkpoints, metrics, the export."""
    if not os.path.isdir(save_dir):
        return False
    for name in os.listdir(save_dir):
        if name == RUN_FILE or name == "latest" or (name.startswith("step") and name[4:].split(".")[0].isdigit()):
            return True
        if name == "metrics.jsonl" and os.path.getsize(os.path.join(save_dir, name)) > 0:
            return True
    return False


class RunFolder:
    """Rank 0's claim on the folder: the lock and run.json. `close()` releases the lock."""

    def __init__(self, save_dir: str, lock_file, run_id: str):
        self.save_dir, self._lock, self.run_id = save_dir, lock_file, run_id

    def close(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None


def _now() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def _what(save_dir: str, path: str) -> str:
    """What the claim was writing at `path`, in words."""
    name = os.path.basename(path.rstrip(os.sep))
    if os.path.abspath(path) == os.path.abspath(save_dir):
        return f"the folder {path}"
    if name == LOCK:
        return f"its lock file {path}"
    if name.startswith(RUN_FILE):
        return f"its run record {path}"
    return path


def refused(save_dir: str, e: OSError, resume_from: str | None) -> RunFolderError:
    """The one line for a folder the filesystem will not let this run write."""
    why = f"{e.strerror or e} (errno {errno.errorcode.get(e.errno, e.errno)})"
    line = (f"trainer.save_dir '{save_dir}' cannot be written: {why} while creating "
            f"{_what(save_dir, e.filename or save_dir)}: point trainer.save_dir at a writable folder "
            "(e.g. trainer.save_dir=runs/my_run)")
    if resume_from is not None and holds_a_run(save_dir):
        from train.runtime.checkpoint import find_latest  # (torch.distributed.checkpoint: only when needed)

        latest = find_latest(save_dir)
        line += ("; to go on with the run it holds, copy the folder to a writable disk and resume there, or "
                 f"resume into a new folder: trainer.save_dir=<writable folder> trainer.load_ckpt_from={latest}"
                 if latest else "")
    return RunFolderError(line)


def _lock(save_dir: str):
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise RunFolderError(f"trainer.save_dir '{save_dir}' is a file, not a folder: point trainer.save_dir at "
                             "a folder (e.g. trainer.save_dir=runs/my_run)")
    os.makedirs(save_dir, exist_ok=True)
    f = open(os.path.join(save_dir, LOCK), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown process"
        f.close()
        raise RunFolderError(f"trainer.save_dir '{save_dir}' is in use by a live run ({holder}): wait for it "
                             "to end, or choose another trainer.save_dir") from None
    return f


def _move_aside(save_dir: str) -> str:
    """Every entry but the lock into a sibling `<save_dir>.replaced-<time>` folder; its path."""
    aside = f"{save_dir.rstrip(os.sep)}.replaced-{_now()}"
    n = 1
    while os.path.exists(aside):
        n += 1
        aside = f"{save_dir.rstrip(os.sep)}.replaced-{_now()}-{n}"
    os.makedirs(aside)
    for name in os.listdir(save_dir):
        if name != LOCK:
            os.rename(os.path.join(save_dir, name), os.path.join(aside, name))
    return aside


def replaces_a_run(save_dir: str, resume_from: str | None, overwrite: bool) -> bool:
    """Whether a start moves a run aside (trainer.overwrite=true over a folder that holds one). Raises
    RunFolderError for a folder that holds a run when neither a resume nor the overwrite was asked:
    the rule rank 0 applies when it claims the folder, and the pre-flight check before torchrun."""
    if resume_from is not None or not holds_a_run(save_dir):
        return False
    if not overwrite:
        raise RunFolderError(
            f"trainer.save_dir '{save_dir}' already holds a run: resume it with "
            "trainer.load_ckpt_from=latest, choose another trainer.save_dir (or trainer.experiment_name), "
            f"or set trainer.overwrite=true to move it aside to '{save_dir.rstrip(os.sep)}.replaced-<time>' "
            "and start over (nothing is deleted)")
    return True


def _claim(save_dir: str, resume_from: str | None, overwrite: bool) -> tuple[RunFolder, str | None]:
    lock = _lock(save_dir)
    try:
        run_file = os.path.join(save_dir, RUN_FILE)
        moved = _move_aside(save_dir) if replaces_a_run(save_dir, resume_from, overwrite) else None
        lock.seek(0)
        lock.truncate()  # who holds the folder, for the message a second run gets
        lock.write(f"pid {os.getpid()} on {socket.gethostname()} since {_now()}\n")
        lock.flush()
        info = {"run_id": uuid.uuid4().hex, "starts": []}
        if os.path.exists(run_file):
            with open(run_file) as f:
                info = json.load(f)
        info["starts"].append({"time": _now(), "host": socket.gethostname(), "pid": os.getpid(),
                               "resumed_from": resume_from})
        tmp = run_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f, indent=1)
        os.replace(tmp, run_file)
        return RunFolder(save_dir, lock, info["run_id"]), moved
    except BaseException:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
        raise


def claim(save_dir: str, resume_from: str | None, overwrite: bool, ctx: DistContext) -> tuple[RunFolder | None, str | None]:
    """Rank 0 claims the folder; every rank raises the same RunFolderError if it cannot (collective).
    Returns (rank 0's RunFolder, else None; where an overwritten run was moved, or None)."""
    outcome: tuple = (None, None, None)
    if ctx.is_main:
        try:
            folder, moved = _claim(save_dir, resume_from, overwrite)
            outcome = (folder, moved, None)
        except RunFolderError as e:
            outcome = (None, None, str(e))
        except OSError as e:  # read-only, not ours: one line on every rank instead of a traceback on one
            if e.errno not in REFUSED_ERRNOS:
                raise
            outcome = (None, None, str(refused(save_dir, e, resume_from)))
    error, moved = broadcast_from_main((outcome[2], outcome[1]), ctx)
    if error:
        raise RunFolderError(error)
    return outcome[0], moved
