"""Benchmark (any machine): where a one-shot census reads NVML, measured without a GPU, against
procps's `ps -eo pid,ppid,stat,sess,comm,args` in the same run.

    python3 bench/nvml_overlap_bench.py [--program-dir DIR ...] [--counts 300 1000] [--repeat 15]

Each run is a new interpreter that loads the census program of `--program-dir` (default: this
checkout's probes/; give two to compare two trees, e.g. a checkout of the previous head), is
told that an NVIDIA driver is registered (`nvidia_registered` answers True), and takes a
one-shot census as `chaosgpu snapshot` does (`workers=0`, no fd scan). The census then reads
NVML as on a GPU node (a forked child or a thread: `observer.gpu_reader`); here that reading is
the loading of NVML and a failed init (no library): the part of NVML's cost that is not the
driver's. Trees before round 16 load NVML with pynvml's import, later ones with ctypes' import
and their own calls; pynvml must be importable (nvidia-ml-py) for the older trees. Trees and
`ps` are measured interleaved; it prints the median time of the interpreter with the census
(imports included), the whole process, and `ps`, with the ratio to `ps`, and writes
bench/results/nvml-overlap-<date>.txt.
The sleepers it forks are killed and reaped before it exits; the last line proves it.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _results import write  # noqa: E402

# argv: the program's folder. Prints the seconds from start to the census made, the reader
# of NVML and the readers of /proc.
CENSUS = r"""
import sys, time
began = time.perf_counter()
sys.path.insert(0, sys.argv[1])
import node_census as census
census.nvidia_registered = lambda proc_root="/proc": True
document = census.census(workers=0, fds=False)
print(time.perf_counter() - began, document["observer"]["gpu_reader"],
      document["observer"]["readers"])
"""

PS = ["ps", "-eo", "pid,ppid,stat,sess,comm,args"]


def _sleepers(count: int) -> list[int]:
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the sleeper
            while True:
                signal.pause()
        pids.append(pid)
    return pids


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        os.waitpid(pid, 0)
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program-dir", nargs="+", default=[str(ROOT / "probes")])
    parser.add_argument("--counts", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args(argv)
    if any(n < 0 for n in args.counts) or args.repeat < 1:
        parser.error("--counts must be >= 0 and --repeat >= 1")
    for folder in args.program_dir:
        if not (Path(folder) / "node_census.py").is_file():
            parser.error(f"--program-dir {folder}: no node_census.py there")
    try:
        import pynvml  # noqa: F401  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        parser.error("pynvml (nvidia-ml-py) is needed: the NVML child of trees before round 16 "
                     "imports it")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", *args.program_dir,
                    str(Path(pynvml.__file__))], env=env, stdout=subprocess.DEVNULL, check=False)
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    started: list[int] = []
    try:
        for count in sorted(args.counts):
            started += _sleepers(count - len(started))
            time.sleep(1.0)
            say(f"== {count} extra processes ({len(os.listdir('/proc'))} entries in /proc); "
                f"medians of {args.repeat}, interleaved")
            census_s: dict[str, list[float]] = {d: [] for d in args.program_dir}
            wall_s: dict[str, list[float]] = {d: [] for d in args.program_dir}
            readers: dict[str, str] = {}
            ps_s = []
            for _ in range(args.repeat):
                for folder in args.program_dir:
                    began = time.perf_counter()
                    out = subprocess.run([sys.executable, "-c", CENSUS, folder], env=env,
                                         capture_output=True, text=True, check=True).stdout
                    wall_s[folder].append(time.perf_counter() - began)
                    seconds, reader, count_read = out.split()
                    census_s[folder].append(float(seconds))
                    readers[folder] = f"NVML read by: {reader}, /proc readers: {count_read}"
                began = time.perf_counter()
                subprocess.run(PS, stdout=subprocess.DEVNULL, check=True)
                ps_s.append(time.perf_counter() - began)
            ps = statistics.median(ps_s)
            say(f"  {'ps -eo pid,ppid,stat,sess,comm,args':44s} {ps * 1000:8.1f} ms")
            for folder in args.program_dir:
                inside, wall = (statistics.median(v) for v in (census_s[folder], wall_s[folder]))
                say(f"  {folder}: start to census made {inside * 1000:.1f} ms, whole process "
                    f"{wall * 1000:.1f} ms (ratio to ps {wall / ps:.2f}); {readers[folder]}")
    finally:
        clean = _gone(started)
    say(f"sleepers left (all reaped when 0): {0 if clean else 'some'}")
    print(f"written {write('nvml-overlap', chr(10).join(lines) + chr(10))}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
