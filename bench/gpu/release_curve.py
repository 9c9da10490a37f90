"""Release curves: how GPU memory comes back after SIGKILL of 1, 10 or 100 torch workers at once.

    python3 bench/gpu/release_curve.py run OUT.json [--workers 1 10 100] [--mib 256]
    python3 bench/gpu/release_curve.py plot OUT.json PLOT.png

`run` starts N chaosgpu hold workers (torch, ignoring SIGTERM, like the field report's), waits
until all hold their memory, samples GPU memory with chaosgpu's timeline sampler at 100 Hz
(10 ms), kills them all through stop_workload (grace 0: SIGKILL, pidfds) and records the curve
until the memory is back within --tolerance-mib of the baseline. `plot` draws the curves
(matplotlib). Needs a GPU with NVML and torch; writes nothing outside OUT.json / PLOT.png and
the state dir, and leaves no worker behind (stop_workload again on any error).
"""

import argparse
import json
import sys
import time
from typing import Any


def _curve(workers: int, mib: int, tolerance_mib: float, spawn_timeout_s: float,
           release_timeout_s: float) -> dict[str, Any]:
    from chaosgpu.timeline.sampler import Sampler
    from chaosgpu.workloads.actions import start_holders, stop_workload

    tag = f"release-curve-{workers}"
    sampler = Sampler(rate_hz=100, process_every=50, scope={"tag": tag}, source="nvml")
    sampler.start()
    try:
        sampler.wait_samples(20, 5.0)
        baseline = sampler.take_baseline()["total_mib"]
        started = time.monotonic()
        sampler.mark("spawn", "start")
        start_holders(count=workers, mib=mib, via="torch", on_sigterm="ignore", tag=tag,
                      timeout_s=spawn_timeout_s)
        spawn_s = time.monotonic() - started
        time.sleep(1.0)
        _, totals = sampler.snapshot()
        held = totals[-1]
        kill_t = sampler.mark("kill", "start")["t"]
        stopped = stop_workload(tag, grace_s=0, deadline_s=60)
        gone_t = sampler.now()
        deadline = time.monotonic() + release_timeout_s
        released_t = None
        while time.monotonic() < deadline:
            t, totals = sampler.snapshot()
            if totals and totals[-1] <= baseline + tolerance_mib:
                released_t = t[-1]
                break
            time.sleep(0.01)
        time.sleep(0.3)
    finally:
        stop_workload(tag, grace_s=0, deadline_s=60)
        sampler.stop()
    t, totals = sampler.snapshot()
    window = [(ti - kill_t, v) for ti, v in zip(t, totals, strict=True) if ti >= kill_t - 0.5]
    half_level = baseline + (held - baseline) / 2
    half_t = next((ti for ti, v in window if ti >= 0 and v <= half_level), None)
    summary = sampler.summary()
    return {"workers": workers, "mib_each": mib, "spawn_s": round(spawn_s, 2),
            "baseline_mib": round(baseline, 1), "held_mib": round(held, 1),
            "held_gib_above_baseline": round((held - baseline) / 1024, 2),
            "kill_returned_after_s": round(gone_t - kill_t, 3),
            "released_after_s": None if released_t is None else round(released_t - kill_t, 3),
            "half_released_after_s": None if half_t is None else round(half_t, 3),
            "tolerance_mib": tolerance_mib,
            "sampler": {k: summary.get(k) for k in ("rate_hz", "samples", "overhead_cpu_pct")},
            "kill": {k: v for k, v in stopped.items() if k != "processes"},
            "series": {"t_s": [round(a, 4) for a, _ in window],
                       "used_mib": [round(b, 1) for _, b in window]}}


def run(path: str, workers: list[int], mib: int, tolerance_mib: float) -> int:
    """Record the curves and write them to `path`."""
    import platform
    import subprocess

    from chaosgpu.node import nvml_snapshot

    gpu = nvml_snapshot(with_processes=False)
    document: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"kernel": platform.release(), "python": platform.python_version(),
                    "driver": gpu.get("driver"),
                    "gpus": [d.get("name") for d in gpu.get("devices") or []],
                    "nvidia_smi": subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                                 text=True).stdout.strip()},
        "command": " ".join(sys.argv), "curves": []}
    for count in workers:
        curve = _curve(count, mib, tolerance_mib, spawn_timeout_s=240.0, release_timeout_s=60.0)
        document["curves"].append(curve)
        print(json.dumps({k: v for k, v in curve.items() if k != "series"}), flush=True)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1)
    return 0


def plot(path: str, out: str) -> int:
    """Draw the curves of `path` into `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path, encoding="utf-8") as handle:
        document = json.load(handle)
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for curve in document["curves"]:
        above = [(v - curve["baseline_mib"]) / 1024 for v in curve["series"]["used_mib"]]
        label = (f"{curve['workers']} worker(s), {curve['held_gib_above_baseline']} GiB: back "
                 f"after {curve['released_after_s']} s")
        axis.plot(curve["series"]["t_s"], above, label=label, linewidth=1.2)
    axis.axvline(0, color="grey", linestyle="--", linewidth=0.8)
    axis.set_xlabel("seconds after SIGKILL of every worker (10 ms samples)")
    axis.set_ylabel("GPU memory above idle (GiB)")
    axis.set_title(f"GPU memory release after SIGKILL ({', '.join(document['machine']['gpus'])},"
                   f" driver {document['machine']['driver']}, {document['date'][:10]})")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line: run | plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("out")
    run_parser.add_argument("--workers", type=int, nargs="+", default=[1, 10, 100])
    run_parser.add_argument("--mib", type=int, default=256)
    run_parser.add_argument("--tolerance-mib", type=float, default=64.0)
    plot_parser = sub.add_parser("plot")
    plot_parser.add_argument("json")
    plot_parser.add_argument("png")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.out, args.workers, args.mib, args.tolerance_mib)
    return plot(args.json, args.png)


if __name__ == "__main__":
    sys.exit(main())
