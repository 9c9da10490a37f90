"""A CUDA device driven through the driver API with ctypes, for chaosgpu's own GPU fault programs.

This module owns what the fault programs (pressure, contention, XID) do on a device: find it by
UUID, take its primary context, query and take memory, load PTX text and launch kernels, copy
device to device, synchronise. libcuda is loaded through `chaosgpu.workloads.cuda_driver` (one
loader). It needs no torch, no CUDA toolkit (the driver compiles the PTX at load time) and must
not start processes or signal anything.
"""

import ctypes
import time
from typing import Any

from chaosgpu.workloads.cuda_driver import CudaDriverError, check_result, load_library

__all__ = ["Device", "CudaDriverError", "error_name", "uuid_text", "PTX_SPIN", "PTX_BAD_WRITE",
           "PTX_TRAP", "PTX_FILL"]

ATTR_MULTIPROCESSOR_COUNT = 16
MIB = 1024 * 1024

# Every thread runs `iters` rounds of 8 dependent FMAs: enough ALU work to keep every SM busy.
# The result is stored so the compiler keeps the loop.
PTX_SPIN = """
.version 7.0
.target sm_70
.address_size 64
.visible .entry chaosgpu_spin(.param .u64 out, .param .u32 iters)
{
  .reg .pred %p;
  .reg .b32 %i, %n, %t, %nt, %ct;
  .reg .f32 %a, %b, %c;
  .reg .b64 %o, %off;
  ld.param.u64 %o, [out];
  ld.param.u32 %n, [iters];
  mov.u32 %t, %tid.x;
  mov.u32 %nt, %ntid.x;
  mov.u32 %ct, %ctaid.x;
  mad.lo.u32 %t, %ct, %nt, %t;
  cvt.rn.f32.u32 %a, %t;
  mov.f32 %b, 0f3F7FFFEF;
  mov.f32 %c, 0f3F800000;
  mov.u32 %i, 0;
LOOP:
  setp.ge.u32 %p, %i, %n;
  @%p bra DONE;
  fma.rn.f32 %c, %a, %b, %c;
  fma.rn.f32 %a, %c, %b, %a;
  fma.rn.f32 %c, %a, %b, %c;
  fma.rn.f32 %a, %c, %b, %a;
  fma.rn.f32 %c, %a, %b, %c;
  fma.rn.f32 %a, %c, %b, %a;
  fma.rn.f32 %c, %a, %b, %c;
  fma.rn.f32 %a, %c, %b, %a;
  add.u32 %i, %i, 1;
  bra LOOP;
DONE:
  mul.wide.u32 %off, %t, 4;
  add.u64 %o, %o, %off;
  st.global.f32 [%o], %a;
  ret;
}
"""

# One thread stores to the address it is given: with an unmapped address, a genuine MMU fault.
PTX_BAD_WRITE = """
.version 7.0
.target sm_70
.address_size 64
.visible .entry chaosgpu_bad_write(.param .u64 where)
{
  .reg .b64 %a;
  .reg .b32 %v;
  ld.param.u64 %a, [where];
  mov.u32 %v, 0xDEADBEEF;
  st.global.u32 [%a], %v;
  ret;
}
"""

# A kernel that executes the trap instruction (an exception raised by the kernel itself).
PTX_TRAP = """
.version 7.0
.target sm_70
.address_size 64
.visible .entry chaosgpu_trap()
{
  trap;
  ret;
}
"""

# Writes `value` into n u32 words: the "is the device still usable" check.
PTX_FILL = """
.version 7.0
.target sm_70
.address_size 64
.visible .entry chaosgpu_fill(.param .u64 out, .param .u32 n, .param .u32 value)
{
  .reg .pred %p;
  .reg .b32 %t, %nt, %ct, %n, %v;
  .reg .b64 %o, %off;
  ld.param.u64 %o, [out];
  ld.param.u32 %n, [n];
  ld.param.u32 %v, [value];
  mov.u32 %t, %tid.x;
  mov.u32 %nt, %ntid.x;
  mov.u32 %ct, %ctaid.x;
  mad.lo.u32 %t, %ct, %nt, %t;
  setp.ge.u32 %p, %t, %n;
  @%p bra DONE;
  mul.wide.u32 %off, %t, 4;
  add.u64 %o, %o, %off;
  st.global.u32 [%o], %v;
DONE:
  ret;
}
"""


def uuid_text(raw: bytes) -> str:
    """NVML's spelling of a 16-byte device UUID: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def error_name(lib: Any, code: int) -> str:
    """The driver's name for result `code` (CUDA_ERROR_ILLEGAL_ADDRESS ...), or the number."""
    name = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return str(name.value.decode())
    except Exception:
        pass
    return str(code)


class Device:
    """One GPU, found by UUID (or CUDA ordinal), with its primary context current on this thread."""

    def __init__(self, uuid: str | None = None, ordinal: int | None = None) -> None:
        self.lib = load_library()
        lib = self.lib
        check_result(lib, lib.cuInit(0), "cuInit")
        count = ctypes.c_int(0)
        check_result(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        found = None
        seen = []
        for index in range(count.value):
            handle = ctypes.c_int(0)
            check_result(lib, lib.cuDeviceGet(ctypes.byref(handle), index), "cuDeviceGet")
            raw = (ctypes.c_char * 16)()
            check_result(lib, lib.cuDeviceGetUuid_v2(raw, handle), "cuDeviceGetUuid_v2")
            text = uuid_text(bytes(raw))
            seen.append(text)
            if (uuid is not None and text.lower() == uuid.lower()) or (
                    uuid is None and ordinal == index):
                found = (index, handle, text)
        if found is None:
            wanted = uuid if uuid is not None else f"ordinal {ordinal}"
            raise CudaDriverError(f"no CUDA device {wanted} in this process (devices: {seen})")
        self.ordinal, self.handle, self.uuid = found
        self.context = ctypes.c_void_p()
        check_result(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), self.handle),
                     "cuDevicePrimaryCtxRetain")
        check_result(lib, lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._allocations: list[int] = []
        self._modules: list[ctypes.c_void_p] = []

    def attribute(self, attribute: int) -> int:
        """cuDeviceGetAttribute."""
        value = ctypes.c_int(0)
        check_result(self.lib, self.lib.cuDeviceGetAttribute(ctypes.byref(value), attribute,
                                                             self.handle), "cuDeviceGetAttribute")
        return value.value

    def sm_count(self) -> int:
        """How many multiprocessors the device has."""
        return self.attribute(ATTR_MULTIPROCESSOR_COUNT)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes as the driver reports them to this context."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        check_result(self.lib, self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)),
                     "cuMemGetInfo_v2")
        return free.value, total.value

    def try_alloc(self, size: int) -> tuple[int, int]:
        """cuMemAlloc_v2 of `size` bytes: (pointer, 0) or (0, the driver's error code)."""
        pointer = ctypes.c_uint64(0)
        code = self.lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size))
        if code != 0:
            return 0, int(code)
        self._allocations.append(pointer.value)
        return pointer.value, 0

    def alloc(self, size: int) -> int:
        """Allocate `size` bytes or raise CudaDriverError."""
        pointer, code = self.try_alloc(size)
        if code:
            raise CudaDriverError(f"cuMemAlloc_v2({size}) failed: {error_name(self.lib, code)}")
        return pointer

    def memset(self, pointer: int, value: int, size: int) -> None:
        """cuMemsetD8_v2 (touches the memory so it is backed)."""
        check_result(self.lib, self.lib.cuMemsetD8_v2(ctypes.c_uint64(pointer),
                                                      ctypes.c_ubyte(value), ctypes.c_size_t(size)),
                     "cuMemsetD8_v2")

    def copy(self, dst: int, src: int, size: int) -> None:
        """cuMemcpyDtoD_v2 (asynchronous with respect to the host for device memory)."""
        check_result(self.lib, self.lib.cuMemcpyDtoD_v2(ctypes.c_uint64(dst), ctypes.c_uint64(src),
                                                        ctypes.c_size_t(size)), "cuMemcpyDtoD_v2")

    def read_u32(self, pointer: int, count: int) -> list[int]:
        """Copy `count` u32 words back to the host."""
        buffer = (ctypes.c_uint32 * count)()
        check_result(self.lib, self.lib.cuMemcpyDtoH_v2(buffer, ctypes.c_uint64(pointer),
                                                        ctypes.c_size_t(4 * count)),
                     "cuMemcpyDtoH_v2")
        return list(buffer)

    def free(self, pointer: int) -> None:
        """cuMemFree_v2 of one of our allocations."""
        if pointer in self._allocations:
            self._allocations.remove(pointer)
            self.lib.cuMemFree_v2(ctypes.c_uint64(pointer))

    def function(self, ptx: str, name: str) -> ctypes.c_void_p:
        """Load PTX text (the driver compiles it for this device) and return kernel `name`."""
        module = ctypes.c_void_p()
        text = ctypes.create_string_buffer(ptx.encode())
        check_result(self.lib, self.lib.cuModuleLoadData(ctypes.byref(module), text),
                     "cuModuleLoadData")
        self._modules.append(module)
        function = ctypes.c_void_p()
        check_result(self.lib, self.lib.cuModuleGetFunction(ctypes.byref(function), module,
                                                            name.encode()), "cuModuleGetFunction")
        return function

    def launch(self, function: ctypes.c_void_p, grid: int, block: int, args: list[Any],
               stream: int = 0) -> int:
        """cuLaunchKernel with ctypes-typed `args`; returns the driver's result code."""
        holders = list(args)
        pointers = (ctypes.c_void_p * max(1, len(holders)))(
            *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in holders])
        return int(self.lib.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0,
                                           ctypes.c_void_p(stream), pointers, None))

    def synchronize(self) -> int:
        """cuCtxSynchronize; returns the driver's result code (an error is sticky after a fault)."""
        return int(self.lib.cuCtxSynchronize())

    def timed(self, function: ctypes.c_void_p, grid: int, block: int, args: list[Any]) -> float:
        """Launch once and wait; return the seconds it took (host clock)."""
        started = time.monotonic()
        code = self.launch(function, grid, block, args)
        if code:
            raise CudaDriverError(f"cuLaunchKernel failed: {error_name(self.lib, code)}")
        code = self.synchronize()
        if code:
            raise CudaDriverError(f"kernel failed: {error_name(self.lib, code)}")
        return time.monotonic() - started

    def close(self) -> None:
        """Free what we allocated and release the primary context (safe to call twice)."""
        for pointer in list(self._allocations):
            self.free(pointer)
        for module in self._modules:
            self.lib.cuModuleUnload(module)
        self._modules = []
        if self.context.value:
            self.lib.cuDevicePrimaryCtxRelease_v2(self.handle)
            self.context = ctypes.c_void_p()
