"""The NVML readings the census does not take: utilisation over time and XID events.

This module is the thin real layer (device memory and processes are read by the census in
probes/node_census.py, never here). It owns: utilisation rates (SM busy %, memory-controller
busy %) and the driver's utilisation sample buffer, and an XID watch (an NVML event set for
nvmlEventTypeXidCriticalError on the chosen devices, read by a thread). Everything that interprets
these readings lives in chaosgpu.gpu.monitor and runs on recorded readings on machines without a
GPU. Errors come back as values ({"available": False, "reason": ...}); nothing here changes a
device.
"""

import threading
import time
from typing import Any

__all__ = ["available", "utilization", "utilization_samples", "XidWatch"]

_lock = threading.Lock()
_module: dict[str, Any] = {"pynvml": None, "reason": None, "tried": False}


def _nvml() -> Any:
    """pynvml, initialised once; raises RuntimeError naming why NVML is unusable."""
    with _lock:
        if not _module["tried"]:
            _module["tried"] = True
            try:
                import pynvml

                pynvml.nvmlInit()
                _module["pynvml"] = pynvml
            except Exception as error:  # not installed, no driver, no GPU
                _module["reason"] = f"NVML unavailable: {error}"
    if _module["pynvml"] is None:
        raise RuntimeError(str(_module["reason"]))
    return _module["pynvml"]


def available() -> tuple[bool, str | None]:
    """(True, None) when NVML can be used here, else (False, why)."""
    try:
        _nvml()
        return True, None
    except RuntimeError as error:
        return False, str(error)


def utilization(index: int) -> dict[str, Any]:
    """One reading: {"t", "gpu_pct" (time a kernel ran), "memory_pct" (time device memory was
    read or written)} over the driver's last sample period."""
    pynvml = _nvml()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
    return {"t": time.time(), "gpu_pct": int(rates.gpu), "memory_pct": int(rates.memory)}


def utilization_samples(index: int, kind: str = "gpu", since_us: int = 0) -> list[list[int]]:
    """The driver's own utilisation samples newer than `since_us` (NVML timestamps, in us):
    [[timestamp_us, percent], ...]; kind "gpu" or "memory"."""
    pynvml = _nvml()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    sampling = (pynvml.NVML_GPU_UTILIZATION_SAMPLES if kind == "gpu"
                else pynvml.NVML_MEMORY_UTILIZATION_SAMPLES)
    try:
        _, samples = pynvml.nvmlDeviceGetSamples(handle, sampling, since_us)
    except pynvml.NVMLError_NotFound:
        return []
    return [[int(s.timeStamp), int(s.sampleValue.uiVal)] for s in samples]


class XidWatch:
    """Collects XID events of the given GPUs (all when None) on a thread until `stop()`."""

    def __init__(self, indexes: list[int] | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self.registered: list[int] = []
        self.unsupported: dict[str, str] = {}
        self.error: str | None = None
        self._stop = threading.Event()
        pynvml = _nvml()
        self._pynvml = pynvml
        count = pynvml.nvmlDeviceGetCount()
        wanted = list(range(count)) if indexes is None else list(indexes)
        self._set = pynvml.nvmlEventSetCreate()
        self._by_handle: dict[int, int] = {}
        for index in wanted:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError,
                                                self._set)
            except pynvml.NVMLError as error:
                self.unsupported[str(index)] = str(error)
                continue
            self.registered.append(index)
            self._by_handle[_address(handle)] = index
        self.started_at = time.time()
        self._thread = threading.Thread(target=self._run, name="chaosgpu-xid-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pynvml = self._pynvml
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(self._set, 100)
            except pynvml.NVMLError_Timeout:
                continue
            except pynvml.NVMLError as error:
                self.error = str(error)
                return
            self.events.append({"t": time.time(), "device": self._by_handle.get(
                _address(data.device)), "event_type": int(data.eventType),
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
            self._pynvml.nvmlEventSetFree(self._set)
        except Exception:
            pass


def _address(handle: Any) -> int:
    import ctypes

    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
