"""memory/<phase>_peak_gib (train/runtime/device_memory.py). CUDA's allocator statistics are replaced by
a scripted counter here (no GPU on this machine): each phase resets the peak when it starts and
records it when it ends; a phase seen twice keeps its larger peak; on CPU nothing is recorded."""
import torch

from train.runtime.device_memory import GIB, PhasePeaks


def test_each_phase_records_the_peak_since_it_began():
    state = {"allocated": 0, "peak": 0}

    def allocate(n: int) -> None:
        state["allocated"] += n
        state["peak"] = max(state["peak"], state["allocated"])

    def reset() -> None:
        state["peak"] = state["allocated"]

    peaks = PhasePeaks(torch.device("cpu"), reset=reset, peak=lambda: state["peak"])
    metrics: dict[str, float] = {}
    with peaks.phase("rollout", metrics):
        allocate(3 * GIB)
        allocate(-2 * GIB)  # the engine's KV buffers freed at the end
    with peaks.phase("update", metrics):
        allocate(2 * GIB)
        allocate(-2 * GIB)
    with peaks.phase("update", metrics):  # a second pass with less: the larger stays
        allocate(GIB // 2)
    assert metrics == {"memory/rollout_peak_gib": 3.0, "memory/update_peak_gib": 3.0}


def test_nothing_is_recorded_on_cpu():
    metrics: dict[str, float] = {}
    with PhasePeaks(torch.device("cpu")).phase("rollout", metrics):
        pass
    assert metrics == {}
