"""What each NVML query costs as the number of live GPU processes grows (run on a GPU machine).

    python3 bench/gpu/nvml_call_costs.py [--steps 0 25 50 100] [--mib 256] [--calls 40]

It starts torch workers (each holds `--mib` MiB on GPU 0 and sleeps) in steps; at each step,
once NVML lists them all and again `--settle-s` later, it times `--calls` calls of every NVML
query a sampler could use for device memory or the process list (the memory info v1 and v2,
the compute, MPS and graphics process lists, the utilisation rates, and chaosgpu's own
process-list read against pynvml's two functions), one memory query from two
threads at once (does the driver serialise them?), and nvidia-smi's own queries (the
reference, a new process each). It prints median / p90 / max wall time per call and writes
bench/results/nvml-calls-<date>.txt. Every worker is killed and reaped before it exits; the
last line proves it.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from _results import write  # noqa: E402

HOLD_GPU = ("import time, torch; x = torch.ones({mib} * 2**20, dtype=torch.uint8, "
            "device='cuda'); torch.cuda.synchronize(); print('ready', flush=True); "
            "time.sleep(3600)")


def _stats(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return (f"median {statistics.median(ordered) * 1e3:8.3f} ms  p90 {p90 * 1e3:8.3f} ms  "
            f"max {ordered[-1] * 1e3:8.3f} ms")


def _time(call: Callable[[], Any], count: int) -> tuple[list[float], str | None]:
    samples: list[float] = []
    for _ in range(count):
        started = time.perf_counter()
        try:
            call()
        except Exception as error:  # a query this driver lacks: say so, keep going
            return samples, f"{type(error).__name__}: {error}"
        samples.append(time.perf_counter() - started)
    return samples, None


def _queries(pynvml: Any, handle: Any) -> dict[str, Callable[[], Any]]:
    queries: dict[str, Callable[[], Any]] = {
        "nvmlDeviceGetMemoryInfo (v1)": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
    }
    if hasattr(pynvml, "nvmlMemory_v2"):
        queries["nvmlDeviceGetMemoryInfo (v2)"] = lambda: pynvml.nvmlDeviceGetMemoryInfo(
            handle, version=pynvml.nvmlMemory_v2)
    queries["nvmlDeviceGetComputeRunningProcesses"] = \
        lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    if hasattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses"):
        queries["nvmlDeviceGetMPSComputeRunningProcesses"] = \
            lambda: pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
    queries["nvmlDeviceGetGraphicsRunningProcesses"] = \
        lambda: pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
    queries["nvmlDeviceGetUtilizationRates"] = \
        lambda: pynvml.nvmlDeviceGetUtilizationRates(handle)
    # what the timeline samples: chaosgpu's one-call listings (compute + MPS), against pynvml's
    # two functions (each asks the driver twice: the count, then the entries)
    from chaosgpu import node

    queries["pynvml compute + MPS lists (the reference)"] = lambda: (
        pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
        pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle))
    queries["chaosgpu nvml_gpu_processes (one call each)"] = node.nvml_gpu_processes
    return queries


def _two_threads(call: Callable[[], Any], count: int) -> str:
    """Wall time of `count` calls split over two threads, against `count` calls in one."""
    started = time.perf_counter()
    for _ in range(count):
        call()
    one = time.perf_counter() - started
    threads = [threading.Thread(target=lambda: [call() for _ in range(count // 2)])
               for _ in range(2)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    two = time.perf_counter() - started
    return f"{count} memory queries: one thread {one * 1e3:.1f} ms, two threads {two * 1e3:.1f} " \
           f"ms (x{one / two:.2f})"


def _smi(args: list[str], count: int) -> str:
    samples: list[float] = []
    for _ in range(count):
        started = time.perf_counter()
        subprocess.run(["nvidia-smi", *args], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        samples.append(time.perf_counter() - started)
    return _stats(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 25, 50, 100])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="each step is timed again this long after the first timing")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    queries = _queries(pynvml, handle)
    procs: list[subprocess.Popen[bytes]] = []
    lines = [f"torch workers holding {args.mib} MiB each on GPU 0 "
             f"({pynvml.nvmlDeviceGetName(handle)}, driver "
             f"{pynvml.nvmlSystemGetDriverVersion()}); {args.calls} calls per query", ""]
    print("\n".join(lines), flush=True)
    try:
        for step in args.steps:
            while len(procs) < step:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", HOLD_GPU.format(mib=args.mib)],
                    stdout=subprocess.DEVNULL, start_new_session=True))
            deadline = time.monotonic() + 600
            listed = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
            while listed < step and time.monotonic() < deadline:
                time.sleep(0.5)
                listed = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
            lines.append(f"== {step} workers started, {listed} compute processes listed by NVML")
            for phase in ("as soon as listed", f"{args.settle_s:.0f} s later"):
                if phase != "as soon as listed":
                    time.sleep(args.settle_s)
                lines.append(f"  -- {phase}")
                for name, call in queries.items():
                    samples, error = _time(call, args.calls)
                    lines.append(f"  {name:44s} " + (_stats(samples) if samples else "")
                                 + (f"  ({error})" if error else ""))
            lines.append("  " + _two_threads(queries["nvmlDeviceGetMemoryInfo (v1)"],
                                             args.calls))
            lines.append("  reference nvidia-smi --query-gpu=memory.used       "
                         + _smi(["--query-gpu=memory.used", "--format=csv,noheader"], 5))
            lines.append("  reference nvidia-smi --query-compute-apps=pid,used_memory "
                         + _smi(["--query-compute-apps=pid,used_memory",
                                 "--format=csv,noheader"], 5))
            print("\n".join(lines[-(2 * len(queries) + 6):]), flush=True)
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in procs:
            proc.wait()
        pynvml.nvmlShutdown()
    left = [proc.pid for proc in procs if proc.returncode is None]
    lines += ["", f"workers left unreaped: {len(left)}"]
    print(lines[-1])
    if not args.no_write:
        print(f"written: {write('nvml-calls', chr(10).join(lines) + chr(10))}")
    return 0 if not left else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # reach the finally: reap all
    sys.exit(main())
