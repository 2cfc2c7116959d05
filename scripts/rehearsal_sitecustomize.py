"""Installed as sitecustomize.py in the venv of scripts/image_rehearsal.sh, never imported by the project.

A CUDA build of torch on a machine without a GPU swaps in a no-op CUDA device guard the first time dynamo
traces (torch._C._ensureCUDADeviceGuardSet); done first in a worker thread (the hf engine compiles in its
thread), a later backward or trace in the main thread segfaults (torch 2.11; a GPU never takes that path).
Here the swap is done in the main thread before it starts another thread, once torch is loaded. It imports
nothing itself: a rank asks to die with its agent before torch loads (tests/integration/test_faults.py).
"""
import sys
import threading

_start = threading.Thread.start


def _start_after_the_guard(self):
    torch = sys.modules.get("torch")
    if (torch is not None and not getattr(_start_after_the_guard, "done", False)
            and threading.current_thread() is threading.main_thread()):
        try:
            if not torch.cuda.is_available() and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
                torch._C._ensureCUDADeviceGuardSet()
            _start_after_the_guard.done = True
        except Exception:  # torch still loading: the next start tries again
            pass
    return _start(self)


threading.Thread.start = _start_after_the_guard
