"""GPU memory through the CUDA driver API (libcuda.so.1) with ctypes, without torch.

This module owns the report's V100 variant: cuInit, cuDeviceGet, cuCtxCreate_v2, cuMemAlloc_v2
and their release, plus a cheap count of usable GPUs (NVML first, the driver otherwise). It must
not import torch and must not start processes.
"""

import ctypes
from typing import Any

__all__ = [
    "CudaDriverError", "DriverAllocation", "check_result", "driver_available", "gpu_count",
    "load_library",
]

CUDA_SUCCESS = 0


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed or libcuda.so.1 could not be loaded."""


def _load() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise CudaDriverError(
            f"libcuda.so.1 cannot be loaded (no NVIDIA driver?): {error}"
        ) from None


def _check(lib: Any, result: int, call: str) -> None:
    if result == CUDA_SUCCESS:
        return
    name = ctypes.c_char_p()
    try:
        lib.cuGetErrorName(result, ctypes.byref(name))
        label = name.value.decode() if name.value else str(result)
    except Exception:
        label = str(result)
    raise CudaDriverError(f"{call} failed: {label} ({result})")


def load_library() -> Any:
    """Return libcuda.so.1 loaded through ctypes (CudaDriverError when there is no driver)."""
    return _load()


def check_result(lib: Any, result: int, call: str) -> None:
    """Raise CudaDriverError naming `call` and the error's name unless `result` is success."""
    _check(lib, result, call)


def driver_available() -> tuple[bool, str | None]:
    """Return (True, None) when the driver API sees at least one device, else (False, why)."""
    try:
        lib = _load()
        _check(lib, lib.cuInit(0), "cuInit")
        count = ctypes.c_int(0)
        _check(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    except CudaDriverError as error:
        return False, str(error)
    if count.value < 1:
        return False, "the CUDA driver sees no device"
    return True, None


def gpu_count() -> int:
    """Return how many GPUs this process can use (NVML, as the census reads it, else the
    driver API); 0 when none."""
    from chaosgpu.node import census_module

    census = census_module()
    try:
        seen = len(census.nvml_device_memory())
    except census.NVMLError:  # a GPU that does not answer: ask the driver API
        seen = 0
    if seen:
        return seen
    try:
        lib = _load()
        _check(lib, lib.cuInit(0), "cuInit")
        count = ctypes.c_int(0)
        _check(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        return count.value
    except CudaDriverError:
        return 0


class DriverAllocation:
    """`mib` MiB of device memory on GPU `device`, held through a driver context until `free()`."""

    def __init__(self, mib: int, device: int = 0) -> None:
        self.mib = mib
        self.device = device
        self._lib = _load()
        self._context = ctypes.c_void_p()
        self._pointer = ctypes.c_uint64(0)
        lib = self._lib
        _check(lib, lib.cuInit(0), "cuInit")
        handle = ctypes.c_int(0)
        _check(lib, lib.cuDeviceGet(ctypes.byref(handle), device), f"cuDeviceGet({device})")
        _check(lib, lib.cuCtxCreate_v2(ctypes.byref(self._context), 0, handle), "cuCtxCreate_v2")
        if mib > 0:
            size = ctypes.c_size_t(mib * 1024 * 1024)
            try:
                _check(lib, lib.cuMemAlloc_v2(ctypes.byref(self._pointer), size), "cuMemAlloc_v2")
                # Touch it so the allocation is backed, like the report's worker.
                _check(lib, lib.cuMemsetD8_v2(self._pointer, 1, size), "cuMemsetD8_v2")
                _check(lib, lib.cuCtxSynchronize(), "cuCtxSynchronize")
            except CudaDriverError:
                self.free()
                raise

    def free(self) -> None:
        """Free the memory and destroy the context (safe to call twice)."""
        if self._pointer.value:
            self._lib.cuMemFree_v2(self._pointer)
            self._pointer = ctypes.c_uint64(0)
        if self._context.value:
            self._lib.cuCtxDestroy_v2(self._context)
            self._context = ctypes.c_void_p()
