"""torchrun whose last line is the trainer's own error: `python -m train.launch` takes torchrun's
arguments and runs its agent in this process,

    .venv/bin/python -m train.launch --standalone --nproc_per_node=2 -m train.trainer.grpo --config-name stub ...

When the ranks stop on an error they wrote down (`error: ...`: config, data, env module, disk,
weight sync), torchrun's ChildFailedError traceback and banner would bury that line; here it comes
last and the exit code is the rank's (2: a mistake to fix, 4: a runtime failure). Any other failure
keeps torchrun's full report.

Preemption: SIGTERM (a scheduler, `kill`) or SIGINT (Ctrl-C) to this process is passed on to the
ranks, which finish the step, save it and exit 0 (train/runtime/lifecycle.py); then this process
exits 128 + the signal's number, 143 or 130, with no traceback. That is the code a shell gives a
process ended by the signal: "stopped, run it again with trainer.load_ckpt_from=latest", which
SLURM recipes and Kubernetes' `restartPolicy: ExitCode` treat as retryable, and never 0 (the run
finished) nor 1/2/4 (failed). A rank that fails instead keeps torchrun's failure report. The ranks
have torchrun's `--shutdown-timeout` (default 30 s, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT) to stop;
after it they are killed (a failure). Plain torchrun forwards the signal too, but then raises
SignalException: a traceback and exit 1 after the ranks saved.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from train.runtime.lifecycle import STOP_FILE
from train.utils.torchrun_errors import recorded_line

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the ranks' requested stop (lifecycle.StopRequest)


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is `parent` (Linux /proc): torchrun's ranks, for the agent."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            except (OSError, IndexError):
                continue
            if int(fields[1]) == parent:
                found.append(int(entry))
    return found


class StopForwarding:
    """SIGTERM / SIGINT for this agent: passed to the ranks, whose exit codes then decide the outcome
    (torchrun's own handler raises SignalException and reports a failure whatever the ranks did)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.received: signal.Signals | None = None  # the first stop signal forwarded to the ranks
        self.raised = False  # a stop signal came with no rank running: torchrun's SignalException
        self._folder = tempfile.mkdtemp(prefix="infinite-rl-launch-")
        self.stop_file = os.path.join(self._folder, "stopped")
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        os.environ[STOP_FILE] = self.stop_file  # the ranks inherit it
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.environ.pop(STOP_FILE, None)
        shutil.rmtree(self._folder, ignore_errors=True)

    def ranks_stopped_on(self) -> str | None:
        """The signal the ranks agreed to stop on (they note it in the stop file), else None."""
        try:
            with open(self.stop_file) as f:
                return f.read().strip() or None
        except FileNotFoundError:
            return None

    def _handle(self, signum: int, frame) -> None:
        sig = signal.Signals(signum)
        ranks = child_pids(os.getpid())
        if not ranks:  # rendezvous, or no rank left: nothing to stop gracefully, torchrun's own way
            self.raised = True
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=sig)
        for pid in ranks:  # the rank itself, not its process group: its env workers finish the step
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if self.received is None:
            self.received = sig
            self._timer = threading.Timer(self.timeout_s, self._kill)
            self._timer.daemon = True
            self._timer.start()

    def _kill(self) -> None:
        print(f"error: the ranks did not stop within {self.timeout_s:g} s of {self.received.name} "
              "(torchrun --shutdown-timeout, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT): killing them; "
              "trainer.load_ckpt_from=latest resumes from the newest complete checkpoint",
              file=sys.stderr, flush=True)
        for pid in child_pids(os.getpid()):
            try:
                os.killpg(pid, signal.SIGKILL)  # torchrun starts each rank in a session (group) of its own
            except (ProcessLookupError, PermissionError):
                pass


def stop_forwarding(args) -> StopForwarding | None:
    """Take SIGTERM / SIGINT from torchrun's agent (its supported `--signals-to-handle`), where this
    torch has the option and Linux's /proc lists the ranks; else None (torchrun's behaviour)."""
    if getattr(args, "signals_to_handle", None) is None or not os.path.isdir("/proc/self"):
        return None
    names = {s.name for s in STOP_SIGNALS}
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() not in names)
    timeout = getattr(args, "shutdown_timeout", None)
    if timeout is None:
        timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))  # torchrun's own default
    return StopForwarding(timeout)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    stop = stop_forwarding(args)
    if stop is not None:
        stop.install()
    try:
        run(args)
        stopped_on = stop.ranks_stopped_on() if stop is not None else None
    except ChildFailedError as e:
        root_rank, root = e.get_first_failure()
        lines: list[str] = []
        for _, failure in sorted(e.failures.items()):
            line = recorded_line(failure.message)
            if line is not None and line not in lines:
                lines.append(line)
        if not lines:
            raise
        print("\n".join(lines), file=sys.stderr, flush=True)
        return root.exitcode if root.exitcode > 0 else 1
    except SignalException as e:
        if stop is None or not stop.raised:
            raise  # a signal torchrun handles itself (SIGHUP, SIGQUIT): its report
        code = 128 + int(e.sigval)
        print(f"train.launch: stopped by {e.sigval.name} while no rank was running; exit {code} (run the same "
              "command with trainer.load_ckpt_from=latest to go on)", file=sys.stderr, flush=True)
        return code
    finally:
        if stop is not None:
            stop.close()
    if stopped_on is None:
        return 0  # the run finished (also when a signal came during its last step: nothing to resume)
    code = 128 + int(signal.Signals[stopped_on])
    print(f"train.launch: the ranks stopped on {stopped_on} at a step boundary; exit {code} (run the same command "
          "with trainer.load_ckpt_from=latest to go on)", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
