"""The NVML readings the census does not take: utilisation over time and XID events.

This module is a thin real layer over the census's NVML (probes/node_census.py: the driver's
libnvidia-ml called through ctypes, its initialisation tried again with a backoff where it
failed, so a process started before the driver sees the GPUs once they come). Device memory
and processes are read by the census, never here. This module owns: utilisation rates (SM busy
%, memory-controller busy %), the driver's utilisation sample buffer, and an XID watch (an NVML
event set for critical XID errors on the chosen devices, read by a thread). Everything that
interprets these readings lives in chaosgpu.gpu.monitor and runs on recorded readings on
machines without a GPU. Errors come back as values ({"available": False, "reason": ...});
nothing here changes a device.
"""

import threading
import time
from typing import Any

from chaosgpu.node import census_module

__all__ = ["available", "utilization", "utilization_samples", "XidWatch"]


def _device(index: int) -> tuple[Any, Any]:
    """(NVML, the handle of GPU `index`); RuntimeError naming why NVML is unusable."""
    return census_module().nvml_device(index)


def _library() -> Any:
    """NVML, initialised (as the census initialises it); RuntimeError naming why not."""
    return _device(0)[0]


def available() -> tuple[bool, str | None]:
    """(True, None) when NVML can be used here, else (False, why)."""
    try:
        _library()
        return True, None
    except (RuntimeError, ValueError) as error:
        return False, str(error)


def utilization(index: int) -> dict[str, Any]:
    """One reading: {"t", "gpu_pct" (time a kernel ran), "memory_pct" (time device memory was
    read or written)} over the driver's last sample period."""
    library, handle = _device(index)
    rates = library.nvmlDeviceGetUtilizationRates(handle)
    return {"t": time.time(), "gpu_pct": int(rates.gpu), "memory_pct": int(rates.memory)}


def utilization_samples(index: int, kind: str = "gpu", since_us: int = 0) -> list[list[int]]:
    """The driver's own utilisation samples newer than `since_us` (NVML timestamps, in us):
    [[timestamp_us, percent], ...]; kind "gpu" or "memory"."""
    if kind not in ("gpu", "memory"):
        raise ValueError(f"kind must be 'gpu' or 'memory', got {kind!r}")
    library, handle = _device(index)
    sampling = (library.NVML_GPU_UTILIZATION_SAMPLES if kind == "gpu"
                else library.NVML_MEMORY_UTILIZATION_SAMPLES)
    try:
        samples = library.nvmlDeviceGetSamples(handle, sampling, since_us)
    except library.NVMLError as error:
        if error.value == library.NVML_ERROR_NOT_FOUND:  # no sample newer than since_us
            return []
        raise
    return [[int(stamp), int(value)] for stamp, value in samples]


class XidWatch:
    """Collects XID events of the given GPUs (all when None) on a thread until `stop()`."""

    def __init__(self, indexes: list[int] | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self.registered: list[int] = []
        self.unsupported: dict[str, str] = {}
        self.error: str | None = None
        self._stop = threading.Event()
        library = _library()
        self._library = library
        count = library.nvmlDeviceGetCount()
        wanted = list(range(count)) if indexes is None else list(indexes)
        self._set = library.nvmlEventSetCreate()
        self._by_handle: dict[int, int] = {}
        for index in wanted:
            try:
                _, handle = _device(index)
                library.nvmlDeviceRegisterEvents(handle, library.nvmlEventTypeXidCriticalError,
                                                 self._set)
            except (library.NVMLError, ValueError) as error:
                self.unsupported[str(index)] = str(error)
                continue
            self.registered.append(index)
            self._by_handle[int(handle.value or 0)] = index
        self.started_at = time.time()
        self._thread = threading.Thread(target=self._run, name="chaosgpu-xid-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        library = self._library
        while not self._stop.is_set():
            try:
                data = library.nvmlEventSetWait(self._set, 100)
            except library.NVMLError as error:
                if error.value == library.NVML_ERROR_TIMEOUT:
                    continue
                self.error = str(error)
                return
            self.events.append({"t": time.time(), "device": self._by_handle.get(
                int(data.device or 0)), "event_type": int(data.eventType),
                "xid": int(data.eventData)})

    def wait(self, timeout_s: float, after: float = 0.0) -> list[dict[str, Any]]:
        """Wait up to `timeout_s` for an event at or after unix time `after`; return those seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = [e for e in self.events if e["t"] >= after]
            if seen:
                return seen
            time.sleep(0.02)
        return [e for e in self.events if e["t"] >= after]

    def stop(self) -> None:
        """Stop the thread and free the event set (safe to call twice)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        try:
            self._library.nvmlEventSetFree(self._set)
        except self._library.NVMLError:
            pass
