"""Benchmark (GPU machine): a GPU snapshot through chaosgpu (NVML, device memory + compute
processes) against `nvidia-smi --query-compute-apps=pid,used_memory --format=csv`, same run.

    python3 bench/gpu_snapshot_bench.py [--repeat 2000] [--smi-repeat 20] [--out DIR]

Prints per-snapshot times and the ratio (goal: >= 200x faster, <= 100 us per snapshot) and
writes bench/results/gpu-snapshot-<date>.txt. Without NVML it says so and exits 2.
"""

import argparse
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chaosgpu.node import census_module  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--smi-repeat", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    census = census_module()
    first = census.nvml_snapshot()
    if not first.get("available"):
        print(f"NVML not available: {first.get('reason')}")
        return 2
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"# chaosgpu GPU snapshot bench  {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M:%S}"
        " UTC")
    say(f"# command: {shlex.join(['python3', *sys.argv])}")
    say(f"# machine: {platform.node()} {os.cpu_count()} cpus, kernel {platform.release()}, "
        f"driver {first.get('driver')}, GPUs "
        + ", ".join(f"{d['index']}:{d['name']}" for d in first["devices"]))
    processes = sum(len(d["processes"]) for d in first["devices"])
    say(f"GPU compute processes now: {processes}")

    def per_call(function, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
        samples = []
        for _ in range(repeat):
            started = time.perf_counter()
            function()
            samples.append(time.perf_counter() - started)
        return samples

    def both() -> None:
        census.nvml_device_memory()
        census.nvml_gpu_processes()

    fast = per_call(both, args.repeat)
    memory_only = per_call(census.nvml_device_memory, args.repeat)
    full = per_call(census.nvml_snapshot, max(1, args.repeat // 10))
    smi_cmd = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"]
    smi = per_call(lambda: subprocess.run(smi_cmd, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, check=False),
                   args.smi_repeat)
    for name, samples in (("chaosgpu memory + processes (nvml_device_memory + "
                           "nvml_gpu_processes)", fast),
                          ("chaosgpu memory only (nvml_device_memory)", memory_only),
                          ("chaosgpu nvml_snapshot (uuid, name, memory, processes)", full),
                          (" ".join(smi_cmd), smi)):
        say(f"{name:75s} median {statistics.median(samples) * 1e6:10.1f} us  "
            f"p99 {sorted(samples)[int(len(samples) * 0.99) - 1] * 1e6:10.1f} us  "
            f"(n={len(samples)})")
    ratio = statistics.median(smi) / statistics.median(fast)
    say(f"ratio nvidia-smi / chaosgpu (memory + processes): {ratio:.0f}x  (goal >= 200x); "
        f"chaosgpu {statistics.median(fast) * 1e6:.1f} us (goal <= 100 us)")
    say(f"ratio nvidia-smi / chaosgpu nvml_snapshot: "
        f"{statistics.median(smi) / statistics.median(full):.0f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu-snapshot-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}.txt"
    path.write_text("\n".join(lines) + "\n")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
