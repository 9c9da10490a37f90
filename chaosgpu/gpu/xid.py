"""The XID program: a short-lived process that makes a GPU raise a genuine exception, and the
check that the device is still usable afterwards.

This program owns the faulting kernels: `illegal-address` stores to an unmapped device address
(an MMU fault: the driver reports CUDA_ERROR_ILLEGAL_ADDRESS to this process and, on the node,
an XID such as 31), `trap` executes the trap instruction (CUDA_ERROR_LAUNCH_FAILED, an XID such
as 13). Only this process's context is lost; it exits at once. `--check` instead allocates,
runs a kernel that fills a buffer and reads it back: the device works. Prints one JSON document;
through the CUDA driver API (ctypes). It must not start processes or signal anything.

Exit codes: 0 the expected error was seen (or, with --check, the device works), 1 it was not,
3 no usable GPU.
"""

import argparse
import ctypes
import json
import os
import sys
import time
from typing import Any

__all__ = ["KINDS", "EXPECTED", "BAD_ADDRESS", "build_parser", "main"]

KINDS = ("illegal-address", "trap")
EXPECTED = {"illegal-address": ("CUDA_ERROR_ILLEGAL_ADDRESS",),
            "trap": ("CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_INSTRUCTION")}
# High in the 49-bit virtual address space and never mapped by the driver's allocators.
BAD_ADDRESS = 0x1_DEAD_0000_0000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m chaosgpu.gpu xid",
                                     description="Trigger a genuine GPU exception, or check "
                                                 "that the device works.")
    parser.add_argument("--uuid", help="the GPU's UUID (as NVML spells it)")
    parser.add_argument("--kind", choices=KINDS, default="illegal-address")
    parser.add_argument("--check", action="store_true",
                        help="only check that the device allocates and runs a kernel")
    return parser


def _fault(device: Any, kind: str) -> dict[str, Any]:
    from chaosgpu.gpu.driver import PTX_BAD_WRITE, PTX_TRAP, error_name

    if kind == "illegal-address":
        function = device.function(PTX_BAD_WRITE, "chaosgpu_bad_write")
        args: list[Any] = [ctypes.c_uint64(BAD_ADDRESS)]
    else:
        function = device.function(PTX_TRAP, "chaosgpu_trap")
        args = []
    launched_at = time.time()
    launch = device.launch(function, 1, 1, args)
    sync = device.synchronize()
    seen = error_name(device.lib, sync) if sync else error_name(device.lib, launch)
    return {"kind": kind, "launch_result": error_name(device.lib, launch),
            "error": seen if (sync or launch) else None, "launched_at": launched_at,
            "error_after_s": round(time.time() - launched_at, 6),
            "expected": list(EXPECTED[kind]), "seen_expected": seen in EXPECTED[kind]}


def _check(device: Any) -> dict[str, Any]:
    from chaosgpu.gpu.driver import PTX_FILL

    count = 1 << 20
    buffer = device.alloc(4 * count)
    function = device.function(PTX_FILL, "chaosgpu_fill")
    took = device.timed(function, (count + 255) // 256, 256,
                        [ctypes.c_uint64(buffer), ctypes.c_uint32(count),
                         ctypes.c_uint32(0xC0FFEE)])
    words = device.read_u32(buffer, 16)
    free, total = device.mem_info()
    return {"usable": all(w == 0xC0FFEE for w in words), "kernel_s": round(took, 6),
            "free_mib": free // (1024 * 1024), "total_mib": total // (1024 * 1024)}


def main(argv: list[str] | None = None) -> int:
    """Run the fault (or the check) and print one JSON document."""
    args = build_parser().parse_args(argv)
    document: dict[str, Any] = {"pid": os.getpid(), "tag": os.environ.get("CHAOSGPU_TAG"),
                                "check": args.check}
    try:
        from chaosgpu.gpu.driver import Device

        device = Device(uuid=args.uuid) if args.uuid else Device(ordinal=0)
    except Exception as error:
        document["error"] = f"no usable GPU: {type(error).__name__}: {error}"
        print(json.dumps(document))
        return 3
    document.update(uuid=device.uuid, ordinal=device.ordinal)
    try:
        if args.check:
            document.update(_check(device))
            ok = bool(document["usable"])
        else:
            document.update(_fault(device, args.kind))
            ok = bool(document["seen_expected"])
    except Exception as error:
        document["error"] = f"{type(error).__name__}: {error}"
        ok = False
    print(json.dumps(document), flush=True)
    # After a fault the context is unusable; leave without tearing it down through the driver.
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
