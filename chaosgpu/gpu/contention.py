"""The compute-contention program: keep a GPU's multiprocessors and/or memory busy with a duty
cycle for T seconds, so that a job sharing the device slows down (a straggler).

This program owns the duty-cycle schedule (`run_duty_cycle`: in each period, work for
duty x period, then idle for the rest) and the work itself: a PTX kernel of dependent FMAs on
every SM (`sm`), device-to-device copies of large buffers (`memory`: HBM bandwidth), or both;
through the CUDA driver API (ctypes, no torch). `--backend host` spins a CPU core instead, so
the schedule, readiness and rollback paths run on machines without a GPU. It writes a readiness
file once calibrated and working, a result file with the achieved duty cycle at the end, and
stops at once (exit 0) on SIGTERM. It must not start processes or signal anything.

Exit codes: 0 done (duration over or SIGTERM), 2 bad arguments, 3 no usable GPU.
"""

import argparse
import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from chaosgpu.arguments import FRACTION, POSITIVE_SECONDS, option
from chaosgpu.workloads.readiness import write_ready

__all__ = ["build_parser", "main", "run_duty_cycle", "TARGETS"]

TARGETS = ("sm", "memory", "both")
MIB = 1024 * 1024
LAUNCH_TARGET_S = 0.01
COPY_MIB = 512


def run_duty_cycle(work: Callable[[float], int], duty_cycle: float, period_s: float,
                   duration_s: float, stop: Callable[[], bool],
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Run `work(until)` (which works until the clock passes `until` and returns how many units
    it issued) for duty_cycle x period_s of each period, idle for the rest, until duration_s
    has passed or `stop()` is true. Returns periods, busy and idle seconds, units and the
    achieved duty cycle (busy / elapsed)."""
    started = clock()
    end = started + duration_s
    busy = 0.0
    units = 0
    periods = 0
    while not stop():
        period_start = clock()
        if period_start >= end:
            break
        busy_until = min(end, period_start + duty_cycle * period_s)
        units += work(busy_until)
        worked = clock()
        busy += worked - period_start
        periods += 1
        idle_until = min(end, period_start + period_s)
        while not stop() and clock() < idle_until:
            sleep(min(0.01, max(0.0, idle_until - clock())))
    elapsed = max(1e-9, clock() - started)
    return {"periods": periods, "busy_s": round(busy, 4), "elapsed_s": round(elapsed, 4),
            "units": units, "achieved_duty_cycle": round(busy / elapsed, 4)}


class _GpuWork:
    """Kernels and copies on one device, sized so one launch takes ~5 ms."""

    def __init__(self, uuid: str | None, target: str) -> None:
        from chaosgpu.gpu.driver import PTX_SPIN, Device

        self.device = Device(uuid=uuid) if uuid else Device(ordinal=0)
        self.target = target
        self.grid = self.device.sm_count() * 8
        self.block = 256
        self.out = self.device.alloc(self.grid * self.block * 4)
        self.spin = self.device.function(PTX_SPIN, "chaosgpu_spin")
        self.iters = 1024
        self.launches = 0
        self.copies = 0
        if target in ("sm", "both"):
            self.device.timed(self.spin, self.grid, self.block, self._args(16))  # load, warm up
            took = self.device.timed(self.spin, self.grid, self.block, self._args(self.iters))
            # Grow until one launch clearly outlasts launch and synchronisation costs (~10 us).
            while took < LAUNCH_TARGET_S / 2 and self.iters < 1 << 26:
                self.iters *= 2
                took = self.device.timed(self.spin, self.grid, self.block, self._args(self.iters))
            self.iters = max(1, int(self.iters * LAUNCH_TARGET_S / max(took, 1e-6)))
            self.launch_s = self.device.timed(self.spin, self.grid, self.block,
                                              self._args(self.iters))
        if target in ("memory", "both"):
            self.src = self.device.alloc(COPY_MIB * MIB)
            self.dst = self.device.alloc(COPY_MIB * MIB)
            self.device.memset(self.src, 7, COPY_MIB * MIB)

    def _args(self, iters: int) -> list[Any]:
        return [ctypes.c_uint64(self.out), ctypes.c_uint32(iters)]

    def __call__(self, until: float) -> int:
        units = 0
        while time.monotonic() < until:
            if self.target in ("sm", "both"):
                self.device.launch(self.spin, self.grid, self.block, self._args(self.iters))
                self.launches += 1
            if self.target in ("memory", "both"):
                self.device.copy(self.dst, self.src, COPY_MIB * MIB)
                self.copies += 1
            code = self.device.synchronize()
            if code:
                raise RuntimeError(f"contention work failed on the device (result {code})")
            units += 1
        return units

    def describe(self) -> dict[str, Any]:
        return {"uuid": self.device.uuid, "ordinal": self.device.ordinal, "grid": self.grid,
                "block": self.block, "iters_per_launch": self.iters, "copy_mib": COPY_MIB,
                "launch_s": round(getattr(self, "launch_s", 0.0), 6)}

    def totals(self, busy_s: float) -> dict[str, Any]:
        """What the work did: launches, FMAs (8 per thread per iteration), bytes copied (read
        + written) and the rates over the busy time."""
        fmas = self.launches * self.grid * self.block * self.iters * 8
        moved = self.copies * COPY_MIB * MIB * 2
        busy = max(busy_s, 1e-9)
        return {"launches": self.launches, "copies": self.copies,
                "fma_tflops": round(2 * fmas / busy / 1e12, 2),
                "copy_gb_per_s": round(moved / busy / 1e9, 1)}

    def close(self) -> None:
        self.device.close()


class _HostWork:
    """A CPU spin (machines without a GPU): the same schedule, nothing on a device."""

    def __call__(self, until: float) -> int:
        units = 0
        while time.monotonic() < until:
            sum(range(1000))
            units += 1
        return units

    def describe(self) -> dict[str, Any]:
        return {"uuid": None}

    def totals(self, busy_s: float) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m chaosgpu.gpu contention",
                                     description="Keep a GPU busy with a duty cycle.")
    parser.add_argument("--uuid", help="the GPU's UUID (as NVML spells it)")
    parser.add_argument("--target", choices=TARGETS, default="sm")
    parser.add_argument("--duty-cycle", type=option(FRACTION), default=1.0)
    parser.add_argument("--period-s", type=option(POSITIVE_SECONDS), default=0.1)
    parser.add_argument("--duration-s", type=option(POSITIVE_SECONDS), required=True)
    parser.add_argument("--backend", choices=("driver", "host"), default="driver")
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--result-file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Calibrate, announce readiness, run the duty cycle, write the result file."""
    args = build_parser().parse_args(argv)  # a bad number: usage error, exit 2
    stopped = {"flag": False}

    def _stop(signum: int, frame: Any) -> None:
        stopped["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        work: Any = _GpuWork(args.uuid, args.target) if args.backend == "driver" else _HostWork()
    except Exception as error:
        print(f"contention: no usable GPU: {type(error).__name__}: {error}", file=sys.stderr)
        return 3
    document = {"pid": os.getpid(), "backend": args.backend, "target": args.target,
                "duty_cycle": args.duty_cycle, "period_s": args.period_s,
                "duration_s": args.duration_s, "tag": os.environ.get("CHAOSGPU_TAG"),
                **work.describe(), "t_ready": time.time()}
    write_ready(args.ready_file, document)
    try:
        result = run_duty_cycle(work, args.duty_cycle, args.period_s, args.duration_s,
                                lambda: stopped["flag"])
    finally:
        work.close()
    result.update(stopped_by_sigterm=stopped["flag"], t_end=time.time(),
                  **work.totals(result["busy_s"]))
    if args.result_file:
        write_ready(args.result_file, dict(document, result=result))
    print(f"contention: {json.dumps(result)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
