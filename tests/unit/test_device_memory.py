"""memory/<phase>_peak_gib (train/runtime/device_memory.py). CUDA's allocator statistics are replaced by
a scripted counter here (no GPU on this machine): each phase resets the peak when it starts and
records it when it ends; a phase seen twice keeps its larger peak; on CPU nothing is recorded."""
import torch

from train.runtime.device_memory import GIB, phase_peak


def test_each_phase_records_the_peak_since_it_began():
    state = {"allocated": 0, "peak": 0}

    def allocate(n: int) -> None:
        state["allocated"] += n
        state["peak"] = max(state["peak"], state["allocated"])

    def reset() -> None:
        state["peak"] = state["allocated"]

    cpu, metrics = torch.device("cpu"), {}

    def phase(name: str):
        return phase_peak(cpu, name, metrics, reset=reset, peak=lambda: state["peak"])

    with phase("rollout"):
        allocate(3 * GIB)
        allocate(-2 * GIB)  # the engine's KV buffers freed at the end
    with phase("update"):
        allocate(2 * GIB)
        allocate(-2 * GIB)
    with phase("update"):  # a second pass with less: the larger stays
        allocate(GIB // 2)
    assert metrics == {"memory/rollout_peak_gib": 3.0, "memory/update_peak_gib": 3.0}


def test_nothing_is_recorded_on_cpu():
    metrics: dict[str, float] = {}
    with phase_peak(torch.device("cpu"), "rollout", metrics):
        pass
    assert metrics == {}
