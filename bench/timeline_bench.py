"""The timeline sampler's real rate and CPU cost with many GPU processes, and while they exit.

    python bench/timeline_bench.py [--rates 100 200 500] [--seconds 8] [--processes 100]
    python bench/timeline_bench.py --gpu-workers 100 [--mib 256]       # on a GPU machine

Without a GPU, `--processes` real tagged processes run and NVML is the recorded H200 snapshot
(`--fake-nvml`, default tests/data/nvml_h200_recorded.json) served by a stand-in `pynvml`: one
device with its recorded memory, a compute-process list naming the live tagged processes with
the recorded per-process memory, and each call spinning for its cost recorded on the H200
(FACTS.md: 9 us per memory query, 3.3 ms per process list at 100 processes), so the CPU figure
is the one the sampler would pay there. With `--gpu-workers N`, N real torch workers each hold
`--mib` MiB on the GPU and the real NVML is read (the integrator runs this on the H200).

For each requested rate it runs the sampler (the timeline control's defaults: source auto,
process list and states every `--process-every` samples at most) for `--seconds`, then once
more at the first rate while every process is SIGKILLed (exits seen through pidfds). It prints
the achieved rate against the requested one and the sampler thread's CPU time in % of one core
(goal: >= 100 Hz at < 2 %), and writes bench/results/<name>-<date>.txt. `--busy-main` keeps the
main thread CPU-bound meanwhile (as a busy `chaos run` would: the sampler then waits for the GIL).
Every process it started is killed and reaped before it exits; the last line proves it.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from _results import write  # noqa: E402

HOLD = "import time; x = bytearray({mib} * 2**20); x[::4096] = b'x' * len(x[::4096]); " \
       "time.sleep(3600)"
HOLD_GPU = "import time, torch; x = torch.ones({mib} * 2**20, dtype=torch.uint8, device='cuda'); " \
           "torch.cuda.synchronize(); time.sleep(3600)"
MEMORY_QUERY_S = 9e-6  # FACTS.md, the H200: nvmlDeviceGetMemoryInfo
PROCESS_LIST_S_PER_PROCESS = 3.3e-3 / 100  # FACTS.md: 3.3 ms with 100 processes


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def fake_pynvml(recording: dict[str, Any], live: set[int], cost: bool) -> types.ModuleType:
    """A stand-in `pynvml` answering from a recorded `held` section: device memory = the
    recording's idle use + the recorded per-process memory of each PID in `live`."""
    held = recording.get("held") or recording
    device = held["devices"][0]
    per_process = (device.get("processes") or [{"used_mib": 2658.0}])[0]["used_mib"]
    idle = ((recording.get("idle") or held)["devices"][0]["memory_used_mib"])
    mib = 2 ** 20
    module = types.ModuleType("pynvml")

    def memory(handle: int) -> Any:
        if cost:
            _spin(MEMORY_QUERY_S)
        used = (idle + per_process * len(live)) * mib
        return types.SimpleNamespace(used=int(used), total=int(device["memory_total_mib"] * mib),
                                     free=int(device["memory_total_mib"] * mib - used))

    def processes(handle: int) -> list[Any]:
        pids = sorted(live)
        if cost:
            _spin(PROCESS_LIST_S_PER_PROCESS * max(1, len(pids)))
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=int(per_process * mib))
                for pid in pids]

    module.nvmlInit = lambda: None  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda index: index  # type: ignore[attr-defined]
    module.nvmlSystemGetDriverVersion = lambda: held.get("driver") or "?"  # type: ignore
    module.nvmlDeviceGetUUID = lambda handle: device.get("uuid") or "?"  # type: ignore
    module.nvmlDeviceGetName = lambda handle: device.get("name") or "?"  # type: ignore
    module.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    module.nvmlDeviceGetComputeRunningProcesses = processes  # type: ignore[attr-defined]
    module.nvmlDeviceGetGraphicsRunningProcesses = lambda handle: []  # type: ignore
    return module


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(10000))


CALLS: dict[str, list[float]] = {"nvml_device_memory": [], "nvml_gpu_processes": []}


def _time_nvml_calls() -> None:
    """Wrap the two NVML fast paths the sampler calls, to tell their latency from ours."""
    import chaosgpu.node as node

    for name, samples in CALLS.items():
        real = getattr(node, name)

        def timed(real: Any = real, samples: list[float] = samples) -> Any:
            started = time.perf_counter()
            try:
                return real()
            finally:
                samples.append(time.perf_counter() - started)

        setattr(node, name, timed)


def _calls_line() -> str:
    parts = []
    for name, samples in CALLS.items():
        if samples:
            ordered = sorted(samples)
            parts.append(f"{name} median {ordered[len(ordered) // 2] * 1000:.3f} ms, max "
                         f"{ordered[-1] * 1000:.3f} ms ({len(samples)} calls)")
        samples.clear()
    return "  NVML wall time per call: " + "; ".join(parts)


def _run(rate: float, seconds: float, tag: str, process_every: int, busy: bool,
         during: Any = None) -> dict[str, Any]:
    from chaosgpu.timeline.sampler import Sampler

    sampler = Sampler(rate_hz=rate, process_every=process_every, scope={"tag": tag})
    stop = threading.Event()
    spinner = threading.Thread(target=_busy, args=(stop,), daemon=True) if busy else None
    sampler.start()
    try:
        if spinner is not None:
            spinner.start()
        if during is not None:
            time.sleep(min(1.0, seconds / 4))
            during(sampler)
            time.sleep(max(0.0, seconds - min(1.0, seconds / 4)))
        else:
            time.sleep(seconds)
    finally:
        stop.set()
        sampler.stop()
        if spinner is not None:
            spinner.join()
    summary = sampler.summary()
    summary["calls"] = _calls_line()
    summary["exits_seen"] = sum(1 for entry in sampler.processes.values()
                                if entry["states"] and entry["states"][-1][1] in ("gone", "Z"))
    if KILLED_AT and REAPED_AT:  # the driver's teardown: from the SIGKILLs to the last reap
        begin, end = min(KILLED_AT.values()), max(REAPED_AT.values())
        with sampler._data_lock:
            stamps = [t for t in sampler.t if begin <= t <= end]
        edges = [begin, *stamps, end]
        gap = max(b - a for a, b in zip(edges, edges[1:], strict=False))
        summary["teardown"] = (f"  during the teardown ({end - begin:.2f} s, the SIGKILLs to the "
                               f"last reap): {len(stamps)} memory samples, "
                               f"{len(stamps) / (end - begin):.1f} Hz, longest gap "
                               f"{gap * 1000:.1f} ms")
    latencies, reaps, lags = [], [], []
    for pid, at in KILLED_AT.items():
        entry = sampler.processes.get(pid)
        seen = [t for t, label in (entry or {}).get("states", []) if label in ("Z", "gone")]
        if seen:
            latencies.append(seen[0] - at)
            if pid in REAPED_AT:
                reaps.append(REAPED_AT[pid] - at)
                lags.append(seen[0] - REAPED_AT[pid])
    KILLED_AT.clear()
    REAPED_AT.clear()
    for label, values in (("exit stamped by the sampler after its SIGKILL", latencies),
                          ("reaped by the bench (waitpid(-1)) after its SIGKILL", reaps),
                          ("sampler's stamp minus the reap (< 0: seen first)", lags)):
        if values:
            values.sort()
            summary["calls"] += (f"\n  {label}: median {values[len(values) // 2] * 1000:.1f} "
                                 f"ms, max {values[-1] * 1000:.1f} ms ({len(values)} exits)")
    return summary


KILLED_AT: dict[int, float] = {}  # pid -> when it was SIGKILLed (sampler time)
REAPED_AT: dict[int, float] = {}  # pid -> when the bench reaped it (sampler time)


def _floor(rate: float, seconds: float) -> str:
    """The reference for the sampler's CPU: a thread that only wakes at `rate` (one sleep per
    period), then the same asking NVML's device memory once per wake-up, measured here, now.
    What the memory stream cannot cost less than."""
    from chaosgpu.node import nvml_device_memory

    def paced(work: Any) -> float:
        spent: list[float] = []

        def body() -> None:
            cpu, next_at, end = time.thread_time(), time.monotonic(), time.monotonic() + seconds
            while next_at < end:
                next_at += 1.0 / rate
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                work()
            spent.append(time.thread_time() - cpu)

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        return 100.0 * spent[0] / seconds

    bare = paced(lambda: None)
    nvml = paced(nvml_device_memory)
    return (f"floor at {rate:.0f} Hz (a thread that only wakes, {seconds:.0f} s): "
            f"{bare:.3f} % of one core; waking and asking NVML's memory once: {nvml:.3f} %")


def _settle(count: int, limit_s: float = 180.0) -> str:
    """Wait until NVML's memory query is fast again after `count` contexts started (10 calls in
    a row under 1 ms); say how long that took and what the query cost meanwhile."""
    from chaosgpu.node import nvml_device_memory

    started, costs, fast = time.monotonic(), [], 0
    while fast < 10 and time.monotonic() - started < limit_s:
        before = time.perf_counter()
        nvml_device_memory()
        cost = time.perf_counter() - before
        costs.append(cost)
        fast = fast + 1 if cost < 1e-3 else 0
        time.sleep(0.02)
    costs.sort()
    return (f"NVML memory query while the {count} contexts settled: median "
            f"{costs[len(costs) // 2] * 1000:.3f} ms, max {costs[-1] * 1000:.1f} ms; "
            f"{'fast' if fast >= 10 else 'still slow'} after {time.monotonic() - started:.1f} s")


def _line(label: str, rate: float, summary: dict[str, Any]) -> str:
    achieved = summary["rate_hz"] or 0.0
    return (f"{label} requested {rate:.0f} Hz: achieved {achieved} Hz ({achieved / rate:.2f}x), "
            f"CPU {summary['overhead_cpu_pct']} % of one core "
            f"({summary['overhead_cpu_pct_by_thread']}), {summary['samples']} samples, "
            f"source {summary['source']}, tracked {summary['tracked_processes']}, exits seen "
            f"{summary['exits_seen']}, errors {summary['errors']}")


def _kill_all(procs: list[Any], live: set[int], sampler: Any = None) -> None:
    """SIGKILL every worker and reap each as it dies (the reap times are the reference)."""
    for proc in procs:
        proc.kill()
        if sampler is not None:
            KILLED_AT[proc.pid] = sampler.now()
    # reaped in the order they die (os.waitpid(-1) on a thread that does nothing else): the
    # reference for when each exit really happened, against the sampler's stamp
    by_pid = {proc.pid: proc for proc in procs if proc.returncode is None}
    while by_pid:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if sampler is not None:
            REAPED_AT[pid] = sampler.now()
        proc = by_pid.pop(pid, None)
        if proc is not None:
            proc.returncode = os.waitstatus_to_exitcode(status)
    for proc in procs:
        proc.wait()
        live.discard(proc.pid)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 200.0, 500.0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--processes", type=int, default=100,
                        help="tagged CPU processes (no GPU: the recorded NVML lists them)")
    parser.add_argument("--gpu-workers", type=int, default=0, metavar="N",
                        help="N real torch GPU workers instead (real NVML)")
    parser.add_argument("--mib", type=int, default=16, help="memory each process holds")
    parser.add_argument("--fake-nvml", default=str(ROOT / "tests" / "data" /
                                                    "nvml_h200_recorded.json"))
    parser.add_argument("--no-nvml-cost", action="store_true",
                        help="the stand-in NVML answers at once (no recorded H200 call cost)")
    parser.add_argument("--process-every", type=int, default=20)
    parser.add_argument("--busy-main", action="store_true")
    parser.add_argument("--name", default=None, help="results file name prefix")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.seconds <= 0 or args.processes < 1 or args.gpu_workers < 0 or args.mib < 1:
        parser.error("--seconds, --processes and --mib must be > 0, --gpu-workers >= 0")
    gpu = args.gpu_workers > 0
    count = args.gpu_workers if gpu else args.processes
    live: set[int] = set()
    if not gpu:
        import _results

        described = _results.machine()  # before the stand-in, which would name the H200
        _results.machine = lambda: described + " (NVML: the recorded stand-in)"
        from chaosgpu.node import census_module

        census_module()._NVML.update(tried=False, module=None, reason=None)  # init again
        recording = json.loads(Path(args.fake_nvml).read_text(encoding="utf-8"))
        sys.modules["pynvml"] = fake_pynvml(recording, live, not args.no_nvml_cost)
    tag = f"tl-bench-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, CHAOSGPU_TAG=tag)
    code = (HOLD_GPU if gpu else HOLD).format(mib=args.mib)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                              start_new_session=True) for _ in range(count)]
    live.update(p.pid for p in procs)
    nvml = ("real NVML" if gpu else f"recorded NVML ({Path(args.fake_nvml).name}"
            f"{', no call cost' if args.no_nvml_cost else ', H200 call costs'})")
    lines = [f"{count} tagged {'torch GPU workers' if gpu else 'processes'} holding {args.mib} "
             f"MiB each; {nvml}; {args.seconds} s per rate; process list and states every "
             f"{args.process_every} samples at most; main thread "
             f"{'busy' if args.busy_main else 'idle'}", ""]
    ok = True

    def kill_all(sampler: Any = None) -> None:
        _kill_all(procs, live, sampler)

    try:
        from chaosgpu.node import nvml_gpu_processes

        deadline = time.monotonic() + (600 if gpu else 30)
        while len(nvml_gpu_processes()) < count and time.monotonic() < deadline:
            ended = [p.returncode for p in procs if p.poll() is not None]
            if ended:  # a worker that cannot start (no torch, no CUDA): do not wait 10 min
                raise SystemExit(f"{len(ended)} of {count} workers exited before NVML listed "
                                 f"them all (exit codes {sorted(set(ended))}): see their "
                                 "stderr above")
            time.sleep(0.5)
        lines.append(f"GPU processes listed by NVML: {len(nvml_gpu_processes())}")
        if gpu:
            lines.append(_settle(count))
        print("\n".join(lines[-2:]), flush=True)
        lines.append(_floor(args.rates[0], min(args.seconds, 5.0)))
        print(lines[-1], flush=True)
        _time_nvml_calls()
        for rate in args.rates:
            summary = _run(rate, args.seconds, tag, args.process_every, args.busy_main)
            lines += [_line("steady", rate, summary), summary["calls"]]
            print("\n".join(lines[-2:]), flush=True)
            if rate == 100 and ((summary["rate_hz"] or 0) < 99
                                or (summary["overhead_cpu_pct"] or 100) >= 2):
                ok = False
        rate = args.rates[0]
        summary = _run(rate, args.seconds, tag, args.process_every, args.busy_main, kill_all)
        lines += [_line(f"all {count} SIGKILLed at 1 s;", rate, summary), summary["calls"],
                  summary.get("teardown", "  (no teardown timed)")]
        print("\n".join(lines[-3:]), flush=True)
        if summary["exits_seen"] != count:
            ok = False
    finally:
        kill_all()
    left = [p.pid for p in procs if p.returncode is None]
    lines += ["", f"processes left unreaped: {len(left)}",
              "goal: >= 100 Hz at < 2 % of one core, every exit seen; dcgm-exporter samples "
              "every 30 s (3000x coarser than 100 Hz)"]
    print(lines[-2])
    if not args.no_write:
        name = args.name or ("timeline-gpu" if gpu else f"timeline-cpu{os.cpu_count()}")
        print(f"written: {write(name, chr(10).join(lines) + chr(10))}")
    return 0 if ok and not left else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # reach the finally: reap all
    sys.exit(main())
