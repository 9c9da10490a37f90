"""Benchmark: the process census over ~10,000 processes, against `fuser` (and `lsof`) on the
same process tree, in the same run.

    python3 bench/census_bench.py [--processes 10000] [--repeat 5] [--no-lsof] [--out DIR]

It starts a spawner (its own session) that opens a scratch file and forks N children that
pause, each holding that file open (a /dev/nvidia* node cannot be faked without a GPU, so the
fd scan is measured on this file: it reads the same fd links the /dev/nvidia* scan reads). It
then times, several times each: the full census (stat, status, cmdline, cgroup, environ, fd
scan of every process), the census without fd scan, without environ and fds, and
`fuser FILE` / `lsof -t FILE`, prints the ratios and writes bench/results/census-<date>.txt.
Every process it started is killed and reaped before it exits, also on errors.
"""

import argparse
import datetime
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chaosgpu.node import census_module  # noqa: E402

SPAWNER = r"""
import os, signal, sys
n = int(sys.argv[1]); held = open(sys.argv[2], "rb")
kids = []
signal.signal(signal.SIGTERM, lambda *a: None)
for i in range(n):
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with open("/proc/self/comm", "w") as comm:
            comm.write("bench-sleeper")
        while True:
            signal.pause()
    kids.append(pid)
print("ready", flush=True)
signal.pause()
for pid in kids:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
for pid in kids:
    try:
        os.waitpid(pid, 0)
    except OSError:
        pass
"""


def timed(function: Any, repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return samples


def command_timer(argv: list[str]) -> Any:
    def run() -> None:
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return run


def fmt(samples: list[float]) -> str:
    return (f"median {statistics.median(samples) * 1000:8.1f} ms  min "
            f"{min(samples) * 1000:8.1f} ms  (n={len(samples)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-lsof", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error("--processes must be >= 1")
    census = census_module()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    scratch = tempfile.NamedTemporaryFile(prefix="chaosgpu-bench-", delete=False)
    scratch.close()
    env = dict(os.environ, CHAOSGPU_TAG="census-bench")
    spawner = subprocess.Popen([sys.executable, "-c", SPAWNER, str(args.processes), scratch.name],
                               stdout=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        started = time.monotonic()
        assert spawner.stdout is not None
        if spawner.stdout.readline().strip() != "ready":
            raise RuntimeError("the spawner did not start its children")
        now = datetime.datetime.now(datetime.UTC)
        say(f"# chaosgpu census bench  {now:%Y-%m-%d %H:%M:%S} UTC")
        say(f"# command: {shlex.join(['python3', *sys.argv])}")
        say(f"# machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, kernel "
            f"{platform.release()}, Python {platform.python_version()}")
        say(f"# spawned {args.processes} processes holding {scratch.name} in "
            f"{time.monotonic() - started:.1f} s")
        total = len(census.list_pids())
        workers = max(2, min(16, os.cpu_count() or 2))
        say(f"processes in /proc: {total}")
        results = {
            "census full (stat+status+cmdline+cgroup+environ+fd scan)":
                timed(lambda: census.census(gpu=False), args.repeat),
            "census warm cache (stat+cgroup+fd scan; stable fields cached)":
                (census.census(gpu=False, cache=True) and None)
                or timed(lambda: census.census(gpu=False, cache=True), args.repeat),
            f"census full, {workers} forked readers":
                timed(lambda: census.census(gpu=False, workers=workers), args.repeat),
            f"census lite, {workers} forked readers":
                timed(lambda: census.census(gpu=False, detail="lite", workers=workers),
                      args.repeat),
            "census lite (stat+status all; details for candidates only)":
                timed(lambda: census.census(gpu=False, detail="lite"), args.repeat),
            "census lite, warm cache":
                timed(lambda: census.census(gpu=False, detail="lite", cache=True), args.repeat),
            "census without fd scan": timed(lambda: census.census(gpu=False, fds=False),
                                            args.repeat),
            "census without environ and fd scan":
                timed(lambda: census.census(gpu=False, env=False, fds=False), args.repeat),
            "state scan only (list_pids + process_state)":
                timed(lambda: [census.process_state(p) for p in census.list_pids()],
                      args.repeat),
            f"fuser {scratch.name}": timed(command_timer(["fuser", scratch.name]), args.repeat),
        }
        if not args.no_lsof and shutil.which("lsof"):
            results[f"lsof -t {scratch.name}"] = timed(
                command_timer(["lsof", "-t", scratch.name]), max(1, min(args.repeat, 2)))
        full = statistics.median(next(iter(results.values())))
        for name, samples in results.items():
            say(f"{name:60s} {fmt(samples)}")
        fuser = statistics.median(results[f"fuser {scratch.name}"])
        say(f"ratio fuser / census full: {fuser / full:.2f}x  (goal >= 5x)")
        lite = statistics.median(
            results["census lite (stat+status all; details for candidates only)"])
        say(f"ratio fuser / census lite: {fuser / lite:.2f}x;  census lite per 10,000 processes: "
            f"{lite * 10000 / total * 1000:.1f} ms")
        if f"lsof -t {scratch.name}" in results:
            lsof = statistics.median(results[f"lsof -t {scratch.name}"])
            say(f"ratio lsof / census full:  {lsof / full:.2f}x")
        per_10k = full * 10000 / total * 1000
        say(f"census full per 10,000 processes: {per_10k:.1f} ms  (goal <= 100 ms)")
        for mode in ("full", "lite"):
            best = statistics.median(results[f"census {mode}, {workers} forked readers"])
            say(f"census {mode} with {workers} readers: {best * 10000 / total * 1000:.1f} ms per "
                f"10,000 processes; fuser / it = {fuser / best:.2f}x")
        holders = census.census(gpu=False, env=False)
        held = sum(1 for p in holders["processes"] if p["unreadable"])
        say(f"unreadable records in the last census: {held}")
    finally:
        os.kill(spawner.pid, signal.SIGTERM)
        try:
            spawner.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(spawner.pid, signal.SIGKILL)
            spawner.wait()
        os.unlink(scratch.name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"census-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}.txt"
    path.write_text("\n".join(lines) + "\n")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
