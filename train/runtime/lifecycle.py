"""How a rank lives and stops.

* No orphans: torchrun starts each rank in a session of its own, so when the agent is killed
  (`kill -9`, an OOM kill, a lost node shell) nothing signals the ranks; they would keep training
  and writing checkpoints into the run folder, or sit for many minutes retrying the rendezvous
  store. `die_with_parent()` asks the kernel to SIGKILL the rank when its parent dies.
* Requested stops: SIGTERM (preemption, `kill`, torchrun forwarding a Ctrl-C) and SIGINT set a flag;
  the step loop reads it at the next step boundary, every rank agreeing through one all-reduce, saves
  a checkpoint and exits 0. A second SIGINT stops at once. Under `python -m train.launch` the ranks
  also note the agreed signal in the launcher's STOP_FILE, so it exits 128 + the signal's number
  (the run stopped: run it again) and not 0 (the run finished).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_FILE = "INFINITE_RL_STOP_FILE"  # set by train.launch for its ranks: where they note a requested stop


def die_with_parent() -> bool:
    """Under torchrun on Linux: the kernel SIGKILLs this rank when the agent that started it dies.
    Whether that is now in place (False elsewhere: a plain `python -m` run belongs to the user's shell).
    Imports nothing heavy, so the entry point calls it before torch loads (a rank killed while
    importing must not live on either)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the agent died before the request took effect
        os._exit(1)
    return True


class StopRequest:
    """SIGTERM / SIGINT received by this rank, read at step boundaries."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Handle SIGTERM and SIGINT (main thread only, where Python runs signal handlers)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.signal = signum

    def agreed(self, device) -> str | None:
        """The name of the signal if any rank received one (collective: every rank calls it at the
        same step boundary, so all of them stop together), else None."""
        from train.parallel.collectives import all_reduce_max  # torch: not needed by die_with_parent

        got = all_reduce_max(float(self.signal or 0), device)
        if not got:
            return None
        name = signal.Signals(int(got)).name
        tell_launcher(name)
        return name


def tell_launcher(signal_name: str) -> None:
    """Under train.launch: note that the ranks agreed to stop on `signal_name` (every rank, so every
    node's launcher knows, even one whose agent got no signal). Nothing elsewhere."""
    path = os.environ.get(STOP_FILE)
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(signal_name + "\n")
    except OSError as e:
        print(f"warning: cannot tell train.launch that the run stopped on {signal_name} ({e}): "
              "it will exit 0 as if the run had finished", file=sys.stderr, flush=True)
