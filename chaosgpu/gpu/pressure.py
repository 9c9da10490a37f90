"""The memory-pressure holder: take N MiB of a GPU, or all of it but N MiB, and keep it.

This program owns taking device memory from outside a job: through the CUDA driver API (ctypes,
no torch), in chunks, so that "all but N MiB" gets as close as the driver allows; each chunk is
written once so it is backed. "All but N" also takes, for SETTLE_S after the first taking, what
the device frees meanwhile (a job's step scratch held at the first reading), so the job is left
with N MiB and not with N plus its transient peak. It holds the memory until `--duration-s` has
passed, SIGTERM (frees and exits 0 at once) or SIGKILL, and writes a readiness file once the
memory is held.
`--backend host` holds host memory instead (for machines without a GPU: the start, readiness
and rollback paths are the same). It must not start processes or signal anything.

Exit codes: 0 released (duration over or SIGTERM), 2 bad arguments, 3 no usable GPU, 4 the
memory could not be taken.
"""

import argparse
import mmap
import os
import signal
import sys
import time
from typing import Any

from chaosgpu.arguments import SECONDS, option
from chaosgpu.workloads.readiness import write_ready

__all__ = ["build_parser", "main", "wait_for_sigterm"]

MIB = 1024 * 1024
MIN_CHUNK_MIB = 2
#: "all but N": for this long after the first taking, what the device frees is taken as well
SETTLE_S = 0.5
SETTLE_EVERY_S = 0.02


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m chaosgpu.gpu pressure",
                                     description="Take GPU memory and hold it.")
    amount = parser.add_mutually_exclusive_group(required=True)
    amount.add_argument("--mib", type=int, help="MiB to take")
    amount.add_argument("--leave-mib", type=int, help="take all but this many MiB")
    parser.add_argument("--uuid", help="the GPU's UUID (as NVML spells it)")
    parser.add_argument("--backend", choices=("driver", "host"), default="driver")
    parser.add_argument("--chunk-mib", type=int, default=1024)
    parser.add_argument("--duration-s", type=option(SECONDS), default=0.0,
                        help="release after this many seconds (0: hold until stopped)")
    parser.add_argument("--ready-file", required=True)
    return parser


def _take_chunks(device: Any, want: int, chunk: int, exact: bool) -> tuple[int, int]:
    """Take `want` MiB in chunks of at most `chunk` MiB, halving a refused chunk down to
    MIN_CHUNK_MIB. Returns (MiB taken, allocations refused). With
    `exact`, a refusal at the smallest chunk raises MemoryError; otherwise it ends the taking."""
    held = failures = 0
    while held < want:
        size = min(chunk, want - held)
        pointer, code = device.try_alloc(size * MIB)
        if code:
            failures += 1
            if chunk <= MIN_CHUNK_MIB:
                if exact:
                    raise MemoryError(f"the driver refused {size} MiB after {held} MiB were "
                                      "taken")
                break  # all-but-N: as close as the driver allows
            chunk = max(MIN_CHUNK_MIB, chunk // 2)
            continue
        device.memset(pointer, 1, size * MIB)
        held += size
    return held, failures


def _take_driver(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    from chaosgpu.gpu.driver import Device

    device = Device(uuid=args.uuid) if args.uuid else Device(ordinal=0)
    free, total = device.mem_info()
    top_ups = 0
    try:
        if args.mib is not None:
            held, failures = _take_chunks(device, args.mib, args.chunk_mib, True)
        else:
            held, failures = _take_chunks(device, int(free // MIB) - args.leave_mib,
                                          args.chunk_mib, False)
            # A job's memory moves (a step's scratch allocated and freed): what it held at the
            # first reading and frees afterwards is taken too, for SETTLE_S, so the job is left
            # with `leave_mib` and not with that plus its transient peak.
            settle_until = time.monotonic() + SETTLE_S
            while time.monotonic() < settle_until:
                device.synchronize()
                extra = int(device.mem_info()[0] // MIB) - args.leave_mib
                if extra >= MIN_CHUNK_MIB:
                    taken, refused = _take_chunks(device, extra, args.chunk_mib, False)
                    held, failures = held + taken, failures + refused
                    top_ups += 1 if taken else 0
                time.sleep(SETTLE_EVERY_S)
    except MemoryError as error:
        device.close()
        raise MemoryError(f"{error} (free was {free // MIB} MiB of {total // MIB})") from None
    device.synchronize()
    free_after, _ = device.mem_info()
    return device, {"held_mib": held, "target_mib": args.mib if args.mib is not None
                    else int(free // MIB) - args.leave_mib, "free_mib_before": free // MIB,
                    "free_mib_after": free_after // MIB, "total_mib": total // MIB,
                    "uuid": device.uuid, "ordinal": device.ordinal,
                    "refused_allocations": failures, "top_ups": top_ups}


def _take_host(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    area = mmap.mmap(-1, max(1, args.mib) * MIB)
    for offset in range(0, args.mib * MIB, 4096):
        area[offset] = 1
    return area, {"held_mib": args.mib, "target_mib": args.mib, "uuid": None}


def wait_for_sigterm(timeout_s: float | None) -> bool:
    """Block until SIGTERM (already blocked by the caller) arrives or `timeout_s` passes;
    return whether it was SIGTERM."""
    if timeout_s is None:
        signal.sigwait({signal.SIGTERM})
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if signal.sigtimedwait({signal.SIGTERM}, left) is not None:
            return True


def main(argv: list[str] | None = None) -> int:
    """Take the memory, announce readiness, hold until the duration ends or a signal comes."""
    args = build_parser().parse_args(argv)
    if (args.mib is not None and args.mib < 1) or (args.leave_mib is not None
                                                   and args.leave_mib < 0):
        print("pressure: --mib must be >= 1 and --leave-mib >= 0", file=sys.stderr)
        return 2
    if args.chunk_mib < MIN_CHUNK_MIB:
        print(f"pressure: --chunk-mib must be >= {MIN_CHUNK_MIB}", file=sys.stderr)
        return 2
    # SIGTERM is taken synchronously (sigtimedwait): the holder frees and exits 0 at once.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if args.backend == "host" and args.mib is None:
        print("pressure: --backend host needs --mib (no device to leave memory on)",
              file=sys.stderr)
        return 2
    try:
        keep, document = _take_driver(args) if args.backend == "driver" else _take_host(args)
    except MemoryError as error:
        print(f"pressure: {error}", file=sys.stderr)
        return 4
    except Exception as error:  # no driver, no such device
        print(f"pressure: no usable GPU: {type(error).__name__}: {error}", file=sys.stderr)
        return 3
    document.update(pid=os.getpid(), backend=args.backend, tag=os.environ.get("CHAOSGPU_TAG"),
                    duration_s=args.duration_s or None, t_ready=time.time())
    write_ready(args.ready_file, document)
    wait_for_sigterm(args.duration_s if args.duration_s > 0 else None)
    keep.close()
    print(f"pressure: released {document['held_mib']} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
