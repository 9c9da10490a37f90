"""How fast device memory can be read while the driver tears down many CUDA contexts at once
(run on a GPU machine).

    python3 bench/gpu/nvml_teardown.py [--workers 100] [--mib 256] [--rate-hz 100]
                                       [--modes memory memory+list ...]

For each mode it starts `--workers` torch workers (each holds `--mib` MiB on GPU 0 and sleeps),
waits until NVML lists them and its memory query is fast again, starts the mode's readers,
SIGKILLs every worker at once and reaps them. Over the teardown (from the SIGKILL to the last
reap) it prints, per reader, how many answers came, the rate, the longest gap between two
answers and the wall time per call. The modes ask: does the memory query block by itself while
contexts are torn down, or behind another NVML call of the same process (the timeline lists
the GPU processes when memory moves)?

- `memory`: one thread asks the memory (nvmlDeviceGetMemoryInfo) at `--rate-hz`, nothing else.
- `memory+list`: the same, and a second thread lists the compute processes every 100 ms.
- `memory+list-elsewhere`: the memory thread here, the listing in another process.
- `memory-4threads`: four threads ask the memory, each at a quarter of the rate, staggered.
- `smi`: the reference, `nvidia-smi --query-gpu=timestamp,memory.used -lms 10`.

Writes bench/results/nvml-teardown-<date>.txt. Every worker is killed and reaped before it
exits; the last line proves it.
"""

import argparse
import datetime
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _results import write  # noqa: E402

HOLD_GPU = ("import time, torch; x = torch.ones({mib} * 2**20, dtype=torch.uint8, "
            "device='cuda'); torch.cuda.synchronize(); print('ready', flush=True); "
            "time.sleep(3600)")

# argv: what to ask ("memory" or "list"), the period in seconds. Asks until its stdin closes,
# then prints one "started ended" line (monotonic seconds) per call.
ELSEWHERE = r"""
import sys, threading, time, pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
ask = pynvml.nvmlDeviceGetMemoryInfo if sys.argv[1] == "memory" else \
    pynvml.nvmlDeviceGetComputeRunningProcesses
period = float(sys.argv[2])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
calls = []
next_at = time.monotonic()
while not done.is_set():
    now = time.monotonic()
    if now < next_at:
        time.sleep(next_at - now)
    next_at = max(next_at + period, time.monotonic() - period)
    started = time.monotonic()
    ask(handle)
    calls.append((started, time.monotonic()))
print("\n".join(f"{a} {b}" for a, b in calls))
"""


class Reader:
    """A thread asking one NVML query every `period` seconds (first at `offset`); each call's
    start and end are kept."""

    def __init__(self, name: str, ask: Any, period: float, offset: float = 0.0) -> None:
        self.name = name
        self.calls: list[tuple[float, float]] = []
        self._ask = ask
        self._period = period
        self._offset = offset
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        next_at = time.monotonic() + self._offset
        while not self._stop.is_set():
            now = time.monotonic()
            if now < next_at:
                time.sleep(next_at - now)
            # a late call goes at once; a stall is not burst through afterwards
            next_at = max(next_at + self._period, time.monotonic() - self._period)
            started = time.monotonic()
            self._ask()
            self.calls.append((started, time.monotonic()))


class Elsewhere:
    """The same reader in another process (its own NVML client)."""

    def __init__(self, name: str, what: str, period: float) -> None:
        self.name = name
        self.calls: list[tuple[float, float]] = []
        self._proc = subprocess.Popen([sys.executable, "-c", ELSEWHERE, what, str(period)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        out, _ = self._proc.communicate("", timeout=60)
        self.calls = [(float(a), float(b)) for a, b in (line.split() for line in
                                                         out.splitlines() if line.strip())]


class Smi:
    """nvidia-smi's own loop; each answer carries its wall-clock timestamp, turned into this
    process's monotonic time."""

    def __init__(self, period_ms: int) -> None:
        self.name = f"nvidia-smi -lms {period_ms}"
        self.calls: list[tuple[float, float]] = []
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,memory.used", "--format=csv,noheader",
             f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self._proc.send_signal(signal.SIGINT)
        out, _ = self._proc.communicate(timeout=30)
        shift = time.time() - time.monotonic()
        for line in out.splitlines():
            stamp = line.split(",")[0].strip()
            try:
                at = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except ValueError:
                continue
            self.calls.append((at - shift, at - shift))


def _readers(mode: str, pynvml: Any, handle: Any, period: float) -> list[Any]:
    def memory() -> Any:
        return pynvml.nvmlDeviceGetMemoryInfo(handle)

    def listing() -> Any:
        return pynvml.nvmlDeviceGetComputeRunningProcesses(handle)

    if mode == "memory":
        return [Reader("memory", memory, period)]
    if mode == "memory+list":
        return [Reader("memory", memory, period), Reader("list (same process)", listing, 0.1)]
    if mode == "memory+list-elsewhere":
        return [Reader("memory", memory, period), Elsewhere("list (other process)", "list", 0.1)]
    if mode == "memory-4threads":
        return [Reader(f"memory thread {i}", memory, 4 * period, i * period) for i in range(4)]
    if mode == "smi":
        return [Smi(max(1, round(period * 1000)))]
    raise SystemExit(f"unknown mode {mode!r}")


def _window(calls: list[tuple[float, float]], begin: float, end: float) -> str:
    ends = [b for _, b in calls if begin <= b <= end]
    spans = [b - a for a, b in calls if begin <= a <= end]
    edges = [begin, *ends, end]
    gap = max(later - earlier for earlier, later in zip(edges, edges[1:], strict=False))
    text = f"{len(ends):5d} answers, {len(ends) / (end - begin):6.1f} Hz, longest gap " \
           f"{gap * 1e3:7.1f} ms"
    if spans and any(spans):
        text += f"; per call median {statistics.median(spans) * 1e3:7.3f} ms, max " \
                f"{max(spans) * 1e3:7.1f} ms"
    return text


def _start_workers(count: int, mib: int, pynvml: Any, handle: Any) -> tuple[list[Any], str]:
    procs = [subprocess.Popen([sys.executable, "-c", HOLD_GPU.format(mib=mib)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True) for _ in range(count)]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        alive = sum(proc.poll() is None for proc in procs)
        if alive < count:  # a worker that cannot start (no torch, no CUDA): stop here
            _kill_and_reap(procs)
            raise SystemExit(f"{count - alive} of {count} workers exited while starting "
                             "(run HOLD_GPU by hand to see why)")
        listed = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        if listed >= alive:
            break
        time.sleep(0.5)
    # settled: 20 memory queries in a row under 1 ms
    began = time.monotonic()
    fast = 0
    while fast < 20 and time.monotonic() < began + 90:
        started = time.perf_counter()
        pynvml.nvmlDeviceGetMemoryInfo(handle)
        fast = fast + 1 if time.perf_counter() - started < 0.001 else 0
        time.sleep(0.01)
    alive = sum(proc.poll() is None for proc in procs)
    return procs, (f"{alive} of {count} workers alive, {listed} listed by NVML, memory query "
                   f"fast again after {time.monotonic() - began:.1f} s")


def _kill_and_reap(procs: list[Any]) -> tuple[float, float]:
    """SIGKILL every worker's group at once, reap them all; when that began and ended."""
    killed = time.monotonic()
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()
    return killed, time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rate-hz", type=float, default=100.0)
    parser.add_argument("--modes", nargs="+", default=["memory", "memory+list",
                                                       "memory+list-elsewhere",
                                                       "memory-4threads", "smi"])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    period = 1.0 / args.rate_hz
    lines = [f"{args.workers} torch workers holding {args.mib} MiB each on GPU 0 "
             f"({pynvml.nvmlDeviceGetName(handle)}, driver "
             f"{pynvml.nvmlSystemGetDriverVersion()}), all SIGKILLed at once; readers asked "
             f"at {args.rate_hz:g} Hz; figures over the teardown (SIGKILL to the last reap)", ""]
    print("\n".join(lines), flush=True)
    everyone: list[Any] = []
    try:
        for mode in args.modes:
            procs, started = _start_workers(args.workers, args.mib, pynvml, handle)
            everyone += procs
            readers = _readers(mode, pynvml, handle, period)
            for reader in readers:
                reader.start()
            time.sleep(1.0)
            killed, reaped = _kill_and_reap(procs)
            time.sleep(0.5)
            for reader in readers:
                reader.stop()
            first = len(lines)
            lines.append(f"== {mode}: {started}; the last reaped {reaped - killed:.2f} s "
                         "after the SIGKILL")
            lines += [f"  {reader.name:24s} {_window(reader.calls, killed, reaped)}"
                      for reader in readers]
            memory = readers[0].calls
            if mode == "memory-4threads":
                memory = sorted(call for reader in readers for call in reader.calls)
                lines.append(f"  {'memory, the four':24s} {_window(memory, killed, reaped)}")
            lines.append(f"  {'(the second before)':24s} {_window(memory, killed - 1.0, killed)}")
            print("\n".join(lines[first:]), flush=True)
    finally:
        _kill_and_reap(everyone)
        pynvml.nvmlShutdown()
    left = [proc.pid for proc in everyone if proc.returncode is None]
    lines += ["", f"workers left unreaped: {len(left)}"]
    print(lines[-1])
    if not args.no_write:
        print(f"written: {write('nvml-teardown', chr(10).join(lines) + chr(10))}")
    return 0 if not left else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # reach the finally: reap all
    sys.exit(main())
