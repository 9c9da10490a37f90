"""Benchmark: `chaosgpu snapshot --json` and the polled census against procps's
`ps -eo pid,ppid,stat,sess,comm,args`, side by side in one run, at 1,000, 5,000 and 10,000 extra
processes.

    python3 bench/census_bench.py [--counts 1000 5000 10000] [--repeat 7] [--out FILE]
                                  [--other-snapshot PATH]

A spawner (its own session) forks the extra processes in steps (each pauses, holding a scratch
file open, so an fd scan has links to read). At each count it times, interleaved, `--repeat`
times each:

* `ps -eo pid,ppid,stat,sess,comm,args` (the reference: stat, status, environ, cmdline of every
  process);
* `chaosgpu snapshot --json` as a user runs it (a new interpreter; readers picked by
  `auto_workers`, the number one untimed run picked is printed; the fd scan as this node
  needs it: none without an NVIDIA driver);
* the same with `--workers 1` (one reader: what the automatic choice saves);
* the same with `--no-gpu` (no NVML: its import and initialisation, part of the fixed cost);
* the same with `--scan-fds` (every process's fds read, what a GPU node pays), once with the
  automatic readers and once with `--workers 1`;
* the polled census: what the job observer takes every tick (`census(gpu=True, fds=False,
  cache=True)`, warm, in this process) and what the probes take (`gpu=False, fds=False,
  cache=True`), and the job observer's again with /proc listed in full every time (as
  before round 17: a cached census now reads the last one's processes and the PIDs
  allocated since, between full listings). The two job observer's rows trade places every
  other round (the first census after the snapshots finds the kernel's data cold).

Before those, at each count, it prints where the snapshot's time goes (interpreter, imports,
census, JSON) and the kernel's share: the bare open, read and close of the census's five files
and of ps's files for every process, one reader, per file in microseconds (the floor no
reader of those files goes under on one CPU), and the census's files by two readers (what the
machine's CPUs give a forked reader at that moment: on a shared VM, anywhere from 1.1x to 2x).

With `--other-snapshot PATH` (another install's `chaosgpu` command, such as the last
release's in its own virtual environment) that install's `chaosgpu snapshot --json` is timed
in the same rounds, trading places with this one's every other round: an A/B of the change in
one run, on the same machine state.

With `--busy 0 1 2` every count is measured again with that many CPUs kept busy by spinning
tasks (started before, killed and reaped after): what readers buy when the node is not quiet.

It prints the ratios to ps (goal: snapshot <= 1.0, polled census <= 0.3) and writes them with
the command, date and machine to `--out` (default bench/results/census-<date>-cpu<N>.txt).
Every process it started is killed and reaped before it exits, also on errors; the last line
proves it (no process of the spawner's session is left).
"""

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # the chaosgpu under test: the installed one, else this checkout's
sys.path.insert(0, str(ROOT / "bench"))

from _results import machine  # noqa: E402

import chaosgpu  # noqa: E402
from chaosgpu.node import census_module  # noqa: E402

#: the folder the chaosgpu under test is imported from (every command of the bench uses it)
UNDER_TEST = Path(chaosgpu.__file__).resolve().parent.parent

# Reads lines "N" on stdin: forks sleepers until N exist, then prints "ready N". EOF or SIGTERM:
# SIGKILL every sleeper, reap them all, exit.
SPAWNER = r"""
import os, signal, sys
held = open(sys.argv[1], "rb")
kids = []
def finish(*_):
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
    os._exit(0)
signal.signal(signal.SIGTERM, finish)
for line in sys.stdin:
    want = int(line)
    while len(kids) < want:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            with open("/proc/self/comm", "w") as comm:
                comm.write("bench-sleeper")
            while True:
                signal.pause()
        kids.append(pid)
    print("ready", len(kids), flush=True)
finish()
"""

PS = ["ps", "-eo", "pid,ppid,stat,sess,comm,args"]
LISTED_IN_FULL = "polled census, job observer, /proc listed in full"
OTHER_SNAPSHOT = "chaosgpu snapshot --json, the other install"


def _chaosgpu() -> list[str]:
    script = Path(sys.executable).parent / "chaosgpu"
    return [str(script)] if script.exists() else [sys.executable, "-m", "chaosgpu.cli"]


def _where_time_goes(snapshot: list[str], env: dict[str, str], repeat: int) -> str:
    """Medians of the snapshot's parts, each timed on its own: the interpreter's start
    (`python3 -c pass`), the start with chaosgpu's snapshot imported (no census), and the
    census itself as the snapshot's JSON reports it (`duration_ms`); the rest of the wall time
    is the JSON encoding and the output. With an installed command, also the command's own
    start (`chaosgpu --help`: its script and chaosgpu.cli), which shows what the script itself
    costs (a generated console-script wrapper imported `re`, 7 ms, before round 20)."""
    bare = _command([sys.executable, "-c", "pass"], env)
    imported = _command([sys.executable, "-c", "import chaosgpu.node.cli"], env)
    command = _command([snapshot[0], "--help"], env) if snapshot[0] != sys.executable else None
    starts: list[float] = []
    imports: list[float] = []
    helps: list[float] = []
    walls: list[float] = []
    inside: list[float] = []
    for _ in range(repeat):
        for runner, into in ((bare, starts), (imported, imports), (command, helps)):
            if runner is None:
                continue
            began = time.perf_counter()
            runner()
            into.append(time.perf_counter() - began)
        began = time.perf_counter()
        document = subprocess.run(snapshot, stdout=subprocess.PIPE, env=env, cwd=OUTSIDE,
                                  check=True).stdout
        walls.append(time.perf_counter() - began)
        inside.append(json.loads(document)["duration_ms"] / 1000)
    start, imported_s, wall, census_s = (statistics.median(values) for values in
                                         (starts, imports, walls, inside))
    script = (f"; the command's own start (`chaosgpu --help`) "
              f"{statistics.median(helps) * 1000:.1f} ms" if helps else "")
    return (f"where the snapshot's {wall * 1000:.1f} ms go (medians of {repeat}): interpreter "
            f"start {start * 1000:.1f} ms, chaosgpu imports {(imported_s - start) * 1000:.1f} "
            f"ms, census {census_s * 1000:.1f} ms, JSON and the rest "
            f"{(wall - imported_s - census_s) * 1000:.1f} ms{script}")


# Run in a new interpreter (this bench's process has NVML initialised): forks one child after
# another, each as the snapshot's NVML child runs: ctypes imported, NVML's library loaded and
# initialised (the census's own calls, no pynvml), the GPU section read, its result written to
# a pipe, then exit ("exit": the pipe closes with the child's files; "close": the child closes
# its end first, as the census's children do). Prints per phase the median ms.
NVML_CHILD = r"""
import marshal, os, statistics, sys, time
from chaosgpu.node import census_module
census = census_module()
names = ("fork", "import ctypes", "NVML loaded, initialised, handles", "GPU section",
         "result written until the parent reads its end", "then reaped")
phases = {mode: [[] for _ in names] for mode in ("exit", "close")}
for _ in range(int(sys.argv[1])):
    for mode, phase_lists in phases.items():
        read_fd, write_fd = os.pipe()
        began = time.perf_counter()
        child = os.fork()
        if child == 0:
            os.close(read_fd)
            marks = [time.perf_counter()]
            import ctypes  # noqa: F401 (its import is a phase of its own)
            marks.append(time.perf_counter())
            census._nvml()
            marks.append(time.perf_counter())
            census.nvml_snapshot()
            marks.append(time.perf_counter())
            os.write(write_fd, marshal.dumps(marks))
            if mode == "close":
                os.close(write_fd)
            os._exit(0)
        os.close(write_fd)
        data = b""
        while True:
            part = os.read(read_fd, 65536)
            if not part:
                break
            data += part
        seen = time.perf_counter()
        os.close(read_fd)
        os.waitpid(child, 0)
        marks = [began] + marshal.loads(data) + [seen, time.perf_counter()]
        for phase, start, end in zip(phase_lists, marks, marks[1:]):
            phase.append(end - start)
for mode, phase_lists in phases.items():
    print("%s: %s" % (mode, ", ".join("%s %.1f" % (name, 1000 * statistics.median(phase))
                                      for name, phase in zip(names, phase_lists))))
"""


def _nvml_child_costs(env: dict[str, str], repeat: int) -> str:
    """Where the NVML child's time goes (GPU nodes): medians over `repeat` children forked
    one after another by a new interpreter, as the snapshot forks its NVML child."""
    result = subprocess.run([sys.executable, "-c", NVML_CHILD, str(repeat)], env=env,
                            cwd=OUTSIDE, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return f"NVML's child: could not be measured: {result.stderr.strip()[-300:]}"
    modes = "; ".join(result.stdout.strip().splitlines())
    return (f"NVML's child, from fork to reaped (medians of {repeat}, ms; exit: its pipe closed "
            f"by its exit, close: closed before it exits, as the census's children do; the "
            f"census reaps them once it is made): {modes}")


#: the files each reads per process: the census's five (docs/census.md) and what procps's ps
#: opens for `-eo pid,ppid,stat,sess,comm,args` (seen with strace), plus its stat of the folder
CENSUS_FILES = ("stat", "status", "cmdline", "environ", "cgroup")
PS_FILES = ("stat", "status", "environ", "cmdline")


def _kernel_share(repeat: int) -> str:
    """What the kernel alone takes to serve the files, one reader, no parsing (best of
    `repeat`): the floor under any reader of them, in any language, on one CPU."""
    pids = census_module().list_pids()

    def read_some(chosen: list[int], names: tuple[str, ...], stat_folder: bool) -> None:
        for pid in chosen:
                base = f"/proc/{pid}/"
                for name in names:
                    try:
                        fd = os.open(base + name, os.O_RDONLY)
                    except OSError:
                        continue
                    try:
                        os.read(fd, 65536)
                    except OSError:
                        pass
                    os.close(fd)
                if stat_folder:
                    try:
                        os.stat(base)
                    except OSError:
                        pass

    def read(names: tuple[str, ...], stat_folder: bool, forked: bool = False) -> float:
        best = float("inf")
        for _ in range(repeat):
            began = time.perf_counter()
            if forked:  # two readers: a forked child reads every other process (and only
                # that: no lock of this process's threads is taken there)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    child = os.fork()
                if child == 0:
                    try:
                        read_some(pids[1::2], names, stat_folder)
                    finally:
                        os._exit(0)
                read_some(pids[0::2], names, stat_folder)
                os.waitpid(child, 0)
            else:
                read_some(pids, names, stat_folder)
            best = min(best, time.perf_counter() - began)
        return best

    costs = {name: read((name,), False) for name in CENSUS_FILES}
    ours, theirs = read(CENSUS_FILES, False), read(PS_FILES, True)
    halves = read(CENSUS_FILES, False, forked=True)
    each = ", ".join(f"{name} {value * 1e6 / len(pids):.1f}" for name, value in costs.items())
    return (f"the kernel's share (open, read, close; one reader, best of {repeat}): the "
            f"census's files {ours * 1000:.1f} ms, ps's {theirs * 1000:.1f} ms "
            f"(x{ours / theirs:.2f}); us per process: {each}; the census's files by two "
            f"readers (one forked) {halves * 1000:.1f} ms (x{ours / halves:.2f} of one)")


#: where the bench's commands run: not this checkout, whose chaosgpu a `python3 -c` started
#: here would import (its current folder first on sys.path) instead of the one under test
OUTSIDE = "/"


def _command(argv: list[str], env: dict[str, str]) -> Callable[[], None]:
    def run() -> None:
        result = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=env, cwd=OUTSIDE, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{argv} failed: {result.stderr.decode()[-500:]}")
    return run


def _listed_in_full(census: Any) -> Callable[[], None]:
    """The job observer's polled census with /proc listed in full every time (its
    ``FULL_LISTING_S`` set to 0 for the call): what reading the last census's processes and
    the PIDs allocated since saves."""
    def run() -> None:
        every = census.FULL_LISTING_S
        census.FULL_LISTING_S = 0.0
        try:
            census.census(gpu=True, fds=False, cache=True)
        finally:
            census.FULL_LISTING_S = every
    return run


def _timed(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def _measure(subjects: dict[str, Callable[[], object]], repeat: int,
             alternate: list[tuple[str, str]] | None = None) -> dict[str, float]:
    """Median seconds of each subject, measured interleaved (one of each per round) so that a
    load change on the machine hits them all alike. ``alternate``: pairs of subjects that
    trade places every other round, so that each comes first after the same subjects half the
    time (the first census after the snapshots finds the kernel's data cold: an A/B pair)."""
    samples: dict[str, list[float]] = {name: [] for name in subjects}
    for round_ in range(repeat):
        order = list(subjects)
        for pair in (alternate or []) if round_ % 2 else []:
            first, second = order.index(pair[0]), order.index(pair[1])
            order[first], order[second] = order[second], order[first]
        for name in order:
            samples[name].append(_timed(subjects[name]))
    return {name: statistics.median(values) for name, values in samples.items()}


def _session_members(sid: int) -> list[int]:
    census = census_module()
    left = []
    for pid in census.list_pids():
        try:
            if census.read_stat(pid)["sid"] == sid:
                left.append(pid)
        except census.ProcError:
            continue
    return left


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked (a bad value: argparse's error, exit 2)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--busy", type=int, nargs="+", default=[0],
                        help="CPUs kept busy by spinning tasks while measuring (each value a run)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--other-snapshot", metavar="PATH", default=None,
                        help="another install's chaosgpu command, timed in the same rounds")
    args = parser.parse_args(argv)
    if args.other_snapshot and not os.access(args.other_snapshot, os.X_OK):
        parser.error(f"--other-snapshot: {args.other_snapshot} is not an executable file")
    if any(n < 1 for n in args.counts) or args.repeat < 1:
        parser.error("--counts and --repeat must be >= 1")
    if any(n < 0 or n > (os.cpu_count() or 1) for n in args.busy):
        parser.error(f"--busy values must be between 0 and {os.cpu_count()} (the CPUs here)")
    return args


def _subjects(census: Any, snapshot: list[str], env: dict[str, str], other: str | None,
              ) -> tuple[dict[str, Callable[[], object]], list[tuple[str, str]]]:
    """What is timed at each count, in order, and the pairs that trade places every other
    round (``_measure``)."""
    subjects: dict[str, Callable[[], object]] = {
        "ps -eo pid,ppid,stat,sess,comm,args": _command(PS, env),
        "chaosgpu snapshot --json": _command(snapshot, env),
        **({OTHER_SNAPSHOT: _command([other, "snapshot", "--json"],
                                     {k: v for k, v in env.items() if k != "PYTHONPATH"})}
           if other else {}),
        "chaosgpu snapshot --json --workers 1": _command([*snapshot, "--workers", "1"], env),
        "chaosgpu snapshot --json --no-gpu": _command([*snapshot, "--no-gpu"], env),
        "chaosgpu snapshot --json --scan-fds": _command([*snapshot, "--scan-fds"], env),
        "chaosgpu snapshot --json --scan-fds --workers 1":
            _command([*snapshot, "--scan-fds", "--workers", "1"], env),
        "polled census, job observer (gpu, no fds, cache)":
            lambda: census.census(gpu=True, fds=False, cache=True),
    }
    alternate = [("chaosgpu snapshot --json", OTHER_SNAPSHOT)] if other else []
    if hasattr(census, "FULL_LISTING_S"):  # the job observer's, as before round 17
        subjects[LISTED_IN_FULL] = _listed_in_full(census)
        alternate.append(("polled census, job observer (gpu, no fds, cache)", LISTED_IN_FULL))
    subjects["polled census, probes (no gpu, no fds, cache)"] = (
        lambda: census.census(gpu=False, fds=False, cache=True))
    return subjects, alternate


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    census = census_module()
    now = datetime.datetime.now(datetime.UTC)
    out = Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"census-{now:%Y-%m-%d}-cpu{os.cpu_count()}.txt")
    lines = [f"command: {' '.join(['python3', 'bench/census_bench.py', *sys.argv[1:]])}",
             f"date: {now:%Y-%m-%dT%H:%M:%SZ}", f"machine: {machine()}", ""]

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    # the snapshot as installed: bytecode compiled once (an installed wheel has it), and the
    # environment as a user has it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if UNDER_TEST == ROOT:  # not installed: this checkout, for the commands too
        env["PYTHONPATH"] = str(ROOT)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "chaosgpu"),
                    str(ROOT / "probes")], env=env, stdout=subprocess.DEVNULL, check=False)
    snapshot = [*_chaosgpu(), "snapshot", "--json"]
    subjects, alternate = _subjects(census, snapshot, env, args.other_snapshot)
    say("snapshot run as: " + ("the installed `chaosgpu` command" if snapshot[0] != sys.executable
                               else "`python -m chaosgpu.cli` from the checkout") + ", from "
        + ("a virtual environment" if sys.prefix != sys.base_prefix else "the system Python"))
    say("chaosgpu under test (the snapshot, the polled census, NVML's child): "
        + ("this checkout's" if UNDER_TEST == ROOT else "the installed one"))
    if args.other_snapshot:
        say(f"the other install's snapshot ({OTHER_SNAPSHOT!r}): {args.other_snapshot}")
    say(f"fd scan on this node: {census.census(pids=[os.getpid()])['observer']['nvidia_fd_scan']}")
    scratch = tempfile.NamedTemporaryFile(prefix="chaosgpu-bench-", delete=False)
    scratch.close()
    script = Path(scratch.name + ".py")  # a short cmdline, as most processes have
    script.write_text(SPAWNER, encoding="utf-8")
    spawner = subprocess.Popen([sys.executable, str(script), scratch.name],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    assert spawner.stdin is not None and spawner.stdout is not None
    try:
        for count in sorted(args.counts):
            started = time.monotonic()
            spawner.stdin.write(f"{count}\n")
            spawner.stdin.flush()
            if spawner.stdout.readline().split() != ["ready", str(count)]:
                raise RuntimeError("the spawner did not start its processes")
            total = len(census.list_pids())
            say(f"== {count} extra processes ({total} in /proc, spawned in "
                f"{time.monotonic() - started:.1f} s); medians of {args.repeat}, interleaved")
            picked = json.loads(subprocess.run(
                snapshot, stdout=subprocess.PIPE, env=env, cwd=OUTSIDE, check=True,
            ).stdout)["observer"].get("readers")
            say(f"  readers `chaosgpu snapshot` picks here (one untimed run): {picked}")
            say("  " + _where_time_goes(snapshot, env, args.repeat))
            say("  " + _kernel_share(args.repeat))
            if census.nvidia_registered():
                say("  " + _nvml_child_costs(env, args.repeat))
            census.census(gpu=True, fds=False, cache=True)  # warm the cache (polled census)
            time.sleep(2.1)  # the cache keeps processes older than 2 s
            census.census(gpu=True, fds=False, cache=True)
            for busy in args.busy:
                if busy or len(args.busy) > 1:
                    say(f"  -- {busy} CPU(s) kept busy by spinning tasks")
                spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                            for _ in range(busy)]
                try:
                    time.sleep(0.3 if busy else 0)
                    medians = _measure(subjects, args.repeat, alternate)
                finally:
                    for spinner in spinners:
                        spinner.kill()
                        spinner.wait()
                ps = medians["ps -eo pid,ppid,stat,sess,comm,args"]
                for name, value in medians.items():
                    say(f"  {name:52s} {value * 1000:8.1f} ms  ratio to ps {value / ps:5.2f}")
                say(f"  goal: snapshot / ps <= 1.0 -> "
                    f"{medians['chaosgpu snapshot --json'] / ps:.2f}; polled / ps <= 0.3 -> "
                    f"{medians['polled census, job observer (gpu, no fds, cache)'] / ps:.2f}")
                if args.other_snapshot:
                    say(f"  this snapshot / the other install's: "
                        f"{medians['chaosgpu snapshot --json'] / medians[OTHER_SNAPSHOT]:.2f}")
    finally:
        try:
            spawner.stdin.close()  # EOF: the spawner SIGKILLs and reaps every sleeper
            spawner.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(spawner.pid, signal.SIGKILL)
            spawner.wait()
        os.unlink(scratch.name)
        script.unlink()
    left = _session_members(spawner.pid)
    say(f"processes left of the spawner's session (all reaped when 0): {len(left)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"written {out}")
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
