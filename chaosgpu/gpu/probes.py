"""Chaos Toolkit probes on GPU memory through NVML.

This module owns the GPU probes that experiments call. Every NVML reading goes through
`chaosgpu.node` (the census in probes/node_census.py): it must not import pynvml itself. NVML
absent is a normal state: `gpu_available` says so, memory probes raise a clear error naming why.
"""

from typing import Any

from chaosgpu.node import nvml_snapshot, take_census

__all__ = ["gpu_available", "gpu_memory_used", "gpu_processes", "process_gpu_memory"]


def _snapshot(device: int | None) -> dict[str, Any]:
    snapshot = nvml_snapshot()
    if not snapshot.get("available"):
        raise RuntimeError(f"no GPU visible through NVML: {snapshot.get('reason')}")
    if device is not None:
        indexes = [d["index"] for d in snapshot["devices"]]
        if not isinstance(device, int) or device not in indexes:
            raise ValueError(f"GPU {device!r} does not exist here; GPUs are {indexes}")
    return snapshot


def gpu_available(configuration: dict[str, Any] | None = None,
                  secrets: dict[str, Any] | None = None) -> bool:
    """Return whether NVML sees at least one GPU here (false without driver, library or GPU)."""
    return bool(nvml_snapshot(with_processes=False).get("available"))


def gpu_memory_used(device: int | None = None, configuration: dict[str, Any] | None = None,
                    secrets: dict[str, Any] | None = None) -> float:
    """Return the GPU memory used in MiB on GPU `device` (all GPUs summed when None), as NVML
    reports it, including the driver's own reservation (~615 MiB on an idle H200): compare it
    with a baseline, not with zero."""
    snapshot = _snapshot(device)
    return float(sum(d["memory_used_mib"] or 0.0 for d in snapshot["devices"]
                     if device is None or d["index"] == device))


def gpu_processes(device: int | None = None, configuration: dict[str, Any] | None = None,
                  secrets: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Return the processes holding GPU memory (on GPU `device`, or all), each with host PID,
    the PID seen here and inside its namespace, container, job, rank and MiB; a process whose
    host PID this observer cannot see says "not visible here" (it is not an orphan)."""
    snapshot = _snapshot(device)
    census = take_census(gpu_snapshot=snapshot, fds=False)
    result: list[dict[str, Any]] = [g for g in census["gpu_processes"]
                                    if device is None or g["gpu_index"] == device]
    return result


def process_gpu_memory(pid: int = 0, device: int | None = None,
                       configuration: dict[str, Any] | None = None,
                       secrets: dict[str, Any] | None = None) -> float:
    """Return the GPU memory in MiB that host PID `pid` holds (on `device`, or all GPUs);
    0.0 when the process holds none (or is gone)."""
    if not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"pid must be a positive host PID, got {pid!r}")
    snapshot = _snapshot(device)
    return float(sum(p["used_mib"] or 0.0 for d in snapshot["devices"]
                     if device is None or d["index"] == device
                     for p in d["processes"] if p["pid"] == pid))
