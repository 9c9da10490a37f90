"""The `hold` reference workload: take N MiB of GPU (or host) memory and keep it.

This module owns the report's worker: memory taken through torch, through the CUDA driver API
(no torch, the report's V100 variant) or, when asked, host memory for machines without a GPU; a
chosen SIGTERM behaviour (ignore like the report's workers, the default exit, or cleanup: free
and exit 0 at once, the report's "scenario 4"); and a readiness file written only once the memory
is held. It must not start other processes or signal anything.

Exit codes: 0 after a cleanup on SIGTERM, 2 bad arguments, 3 no GPU usable (and no host memory
asked for), 4 the allocation failed.
"""

import argparse
import mmap
import os
import signal
import socket
import sys
import time
from typing import Any

from chaosgpu.arguments import TAG, option
from chaosgpu.workloads.readiness import write_ready

__all__ = ["build_parser", "main", "NoGpuError"]

EXIT_NO_GPU = 3
EXIT_ALLOC_FAILED = 4
MIB = 1024 * 1024


class NoGpuError(RuntimeError):
    """No GPU can be used by the requested way of holding memory."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chaosgpu workload hold",
        description="Take N MiB of GPU memory (or host memory) and keep it until killed.",
    )
    parser.add_argument("--mib", type=int, default=256, help="MiB to hold (default 256)")
    parser.add_argument(
        "--via",
        choices=("torch", "driver", "host", "auto"),
        default="auto",
        help="torch tensor, CUDA driver API (ctypes, no torch), host memory, or auto "
        "(torch, else driver; host only with --allow-host-fallback)",
    )
    parser.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    parser.add_argument(
        "--on-sigterm",
        choices=("ignore", "exit", "cleanup"),
        default="ignore",
        help="ignore SIGTERM (the report's workers), exit (default action) or cleanup "
        "(free the memory and exit 0 at once)",
    )
    parser.add_argument("--ready-file", help="write a JSON readiness file here once memory is held")
    parser.add_argument(
        "--tag", type=option(TAG, str),
        help="set CHAOSGPU_TAG=TAG in this process's environment (and its children's); no "
        "whitespace or control characters: a selection matches it exactly",
    )  # fmt: skip
    parser.add_argument(
        "--allow-host-fallback",
        action="store_true",
        help="with --via auto or driver and no usable GPU, hold host memory instead of failing",
    )
    return parser


class _Holder:
    def __init__(self) -> None:
        self.via = "none"
        self.device: int | None = None
        self._keep: Any = None

    def take(self, via: str, mib: int, device: int, allow_host_fallback: bool) -> None:
        if via == "auto":
            via = _resolve_auto(device, allow_host_fallback)
        if via == "torch":
            self._take_torch(mib, device)
        elif via == "driver":
            from chaosgpu.workloads.cuda_driver import DriverAllocation, driver_available

            ok, reason = driver_available()
            if not ok and not allow_host_fallback:
                raise NoGpuError(f"--via driver: {reason}")
            if ok:
                self._keep = DriverAllocation(mib, device)
                self.device = device
            else:
                print(f"hold: --via driver: {reason}; holding host memory instead "
                      "(--allow-host-fallback)", file=sys.stderr)
                via = "host"
                self._take_host(mib)
        else:
            self._take_host(mib)
        self.via = via

    def _take_torch(self, mib: int, device: int) -> None:
        try:
            import torch
        except ImportError:
            raise NoGpuError("--via torch: torch is not installed") from None
        if not torch.cuda.is_available():
            raise NoGpuError("--via torch: torch sees no usable CUDA device")
        if device >= torch.cuda.device_count():
            raise NoGpuError(f"--via torch: no GPU {device} ({torch.cuda.device_count()} seen)")
        tensor = torch.empty(mib * MIB, dtype=torch.uint8, device=f"cuda:{device}")
        tensor.fill_(1)
        torch.cuda.synchronize(device)
        self._keep = tensor
        self.device = device

    def _take_host(self, mib: int) -> None:
        if mib <= 0:
            self._keep = None
            return
        area = mmap.mmap(-1, mib * MIB)
        chunk = b"\x01" * MIB
        for offset in range(0, mib * MIB, MIB):
            area[offset : offset + MIB] = chunk
        self._keep = area

    def free(self) -> None:
        keep, self._keep = self._keep, None
        if keep is None:
            return
        if self.via == "driver":
            keep.free()
        elif self.via == "host":
            keep.close()
        elif self.via == "torch":
            del keep
            import torch

            torch.cuda.empty_cache()


def _resolve_auto(device: int, allow_host_fallback: bool) -> str:
    reasons = []
    try:
        import torch

        if torch.cuda.is_available() and device < torch.cuda.device_count():
            return "torch"
        reasons.append("torch sees no usable CUDA device")
    except ImportError:
        reasons.append("torch is not installed")
    from chaosgpu.workloads.cuda_driver import driver_available

    ok, reason = driver_available()
    if ok:
        return "driver"
    reasons.append(str(reason))
    if allow_host_fallback:
        return "host"
    raise NoGpuError(
        "no GPU usable (" + "; ".join(reasons) + "): use --via host, or --allow-host-fallback"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the holder: take the memory, announce readiness, then wait to be killed."""
    args = build_parser().parse_args(argv)
    if args.mib < 0:
        print("hold: --mib must be >= 0", file=sys.stderr)
        return 2
    if args.device < 0:
        print("hold: --device must be >= 0", file=sys.stderr)
        return 2
    if args.tag and os.environ.get("CHAOSGPU_TAG") != args.tag:
        # Re-exec (same PID) so the tag is in /proc/PID/environ, where the census reads it.
        env = dict(os.environ, CHAOSGPU_TAG=args.tag)
        argv_now = list(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()
        os.execve(
            sys.executable, [sys.executable, "-m", "chaosgpu.workloads", "hold", *argv_now], env
        )
    holder = _Holder()
    if args.on_sigterm == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif args.on_sigterm == "cleanup":

        def _cleanup(signum: int, frame: Any) -> None:
            holder.free()
            sys.stdout.flush()
            os._exit(0)

        signal.signal(signal.SIGTERM, _cleanup)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        holder.take(args.via, args.mib, args.device, args.allow_host_fallback)
    except NoGpuError as error:
        print(f"hold: {error}", file=sys.stderr)
        return EXIT_NO_GPU
    except Exception as error:
        print(f"hold: could not take {args.mib} MiB via {args.via}: {error}", file=sys.stderr)
        return EXIT_ALLOC_FAILED
    document = {
        "pid": os.getpid(),
        "mib": args.mib,
        "via": holder.via,
        "device": holder.device,
        "on_sigterm": args.on_sigterm,
        "tag": os.environ.get("CHAOSGPU_TAG"),
        "sandbox": os.environ.get("CHAOSGPU_SANDBOX"),
        "hostname": socket.gethostname(),
        "t_ready": time.time(),
    }
    if args.ready_file:
        try:
            write_ready(args.ready_file, document)
        except OSError as error:
            print(f"hold: --ready-file {args.ready_file!r} cannot be written: {error}",
                  file=sys.stderr)
            return 2
    while True:
        signal.pause()
