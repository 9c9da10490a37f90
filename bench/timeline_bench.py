"""The timeline sampler's real rate and CPU overhead.

Runs the sampler for `--seconds` at each requested rate while `--processes` tagged processes
each hold `--mib` MiB of host memory (the host-rss source reads each one's RSS every sample),
or with NVML when a GPU is present (`--source nvml`: device memory every sample, the process
list every `--process-every` samples). Overhead = the sampler thread's CPU time / wall time, in
% of one core (goal < 2 % at >= 100 Hz). Compared with dcgm-exporter's default 30 s interval,
the rate figure says how much finer the timeline is. Prints and writes
bench/results/timeline-<date>.txt.

    python bench/timeline_bench.py [--rates 100 200 500] [--seconds 10] [--processes 10]
"""

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write  # noqa: E402

from chaosgpu.timeline.sampler import Sampler  # noqa: E402

HOLD = "import time; x = bytearray({mib} * 2**20); x[::4096] = b'x' * len(x[::4096]); " \
       "time.sleep(3600)"
HOLD_GPU = "import time, torch; x = torch.ones({mib} * 2**20, dtype=torch.uint8, device='cuda'); " \
           "torch.cuda.synchronize(); time.sleep(3600)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 200.0, 500.0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--source", choices=("auto", "nvml", "host-rss"), default="auto")
    parser.add_argument("--process-every", type=int, default=20)
    parser.add_argument("--gpu", action="store_true",
                        help="the tagged processes hold GPU memory through torch (NVML lists them)")
    parser.add_argument("--name", default="timeline", help="results file name prefix")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    tag = f"tl-bench-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, CHAOSGPU_TAG=tag)
    code = (HOLD_GPU if args.gpu else HOLD).format(mib=args.mib)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env,
                              stdin=subprocess.DEVNULL, start_new_session=True)
             for _ in range(args.processes)]
    lines = [f"{args.processes} tagged processes holding {args.mib} MiB each "
             f"({'GPU, torch' if args.gpu else 'host memory'}); "
             f"{args.seconds} s per rate; process list / states every {args.process_every} "
             "samples", ""]
    ok = True
    try:
        time.sleep(1.0)
        if args.gpu:
            from chaosgpu.node import nvml_gpu_processes

            deadline = time.monotonic() + 300
            while len(nvml_gpu_processes()) < args.processes and time.monotonic() < deadline:
                time.sleep(0.5)
            lines.append(f"GPU processes listed by NVML: {len(nvml_gpu_processes())}")
        for rate in args.rates:
            sampler = Sampler(rate_hz=rate, process_every=args.process_every,
                              scope={"tag": tag}, source=args.source)
            sampler.start()
            time.sleep(args.seconds)
            sampler.stop()
            summary = sampler.summary()
            line = (f"requested {rate:.0f} Hz: real {summary['rate_hz']} Hz, "
                    f"{summary['samples']} samples, CPU overhead "
                    f"{summary['overhead_cpu_pct']} % of one core, source {summary['source']}, "
                    f"tracked {summary['tracked_processes']}, peak {summary['peak_total_mib']:.0f}"
                    f" MiB, errors {summary['errors']}")
            lines.append(line)
            print(line, flush=True)
            if rate == 100 and (summary["rate_hz"] < 99 or summary["overhead_cpu_pct"] >= 2):
                ok = False
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    lines += ["", "goal: >= 100 Hz at < 2 % of one core; dcgm-exporter samples every 30 s "
              "(3000x coarser than 100 Hz)"]
    if not args.no_write:
        print(f"written: {write(args.name, chr(10).join(lines) + chr(10))}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
