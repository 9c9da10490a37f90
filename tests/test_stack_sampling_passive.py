"""Taking a rank's Python stack never holds the rank (chaosgpu.job.stacks.take_samples): py-spy
reads its memory without attaching (`--nonblocking`). Attached (py-spy's default), py-spy
ptrace-stops every thread for the dump: the rank pauses, a stop signal arriving meanwhile (a
freeze, a scheduler's suspend) goes to the tracer first, and the dump fails when the rank is
stopped in the middle of it. Checked on real processes and the real py-spy: no tracer is ever
seen on the rank while it is sampled, and a rank stopped in the middle of its sampling is read
and stays stopped."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from proc_helpers import alive, proc_state, wait_until

from chaosgpu.job import stacks

BUSY = "import time\nprint('ready', flush=True)\nwhile True:\n    sum(range(1000))\n"


def _tracer(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


@pytest.fixture()
def busy_rank() -> "subprocess.Popen[str]":
    if stacks.py_spy_path() is None:
        pytest.skip("py-spy is not installed")
    rank = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        yield rank
    finally:
        rank.kill()
        assert rank.wait(timeout=10) == -signal.SIGKILL
        assert not alive(rank.pid)  # ours, killed and reaped: nothing left


def test_sampling_never_attaches_to_the_rank(busy_rank: "subprocess.Popen[str]") -> None:
    """While 30 samples are taken of a running rank, /proc shows no tracer on it at any of
    the reads made in between (a watcher reads TracerPid without pause); every sample has the
    rank's frames."""
    tracers: set[int] = set()
    reads = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal reads
        while not done.is_set():
            tracer = _tracer(busy_rank.pid)
            reads += 1
            if tracer:
                tracers.add(tracer)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(30):
            sample = stacks.take_samples([busy_rank.pid], timeout_s=20)[busy_rank.pid]
            assert sample.error is None, sample.error
            assert any(f.function == "<module>" for t in sample.threads for f in t.frames)
    finally:
        done.set()
        watcher.join()
    assert reads > 100, reads  # the watcher did look while the samples were taken
    assert tracers == set(), f"py-spy attached to the rank as a tracer: {tracers}"


def test_a_rank_stopped_while_it_is_sampled_is_read_and_stays_stopped(
        busy_rank: "subprocess.Popen[str]") -> None:
    """SIGSTOP lands at a random moment of each of 40 samplings (spread over a dump's own
    duration, measured first): each sample still has the rank's stack, and the rank is stopped
    (state T) once the dump is over. Attached, the dump failed in about half of these runs."""
    began = time.monotonic()
    stacks.take_samples([busy_rank.pid], timeout_s=20)
    one_dump_s = time.monotonic() - began
    failed = []
    for attempt in range(40):
        result: dict[int, stacks.StackSample] = {}
        sampler = threading.Thread(target=lambda into=result: into.update(
            stacks.take_samples([busy_rank.pid], timeout_s=20)))
        sampler.start()
        time.sleep(random.uniform(0.0, one_dump_s))
        os.kill(busy_rank.pid, signal.SIGSTOP)
        sampler.join()
        sample = result[busy_rank.pid]
        if sample.error is not None or not sample.threads:
            failed.append((attempt, sample.error))
        assert wait_until(lambda: proc_state(busy_rank.pid) == "T", 5.0), \
            f"attempt {attempt}: the SIGSTOP did not hold (state {proc_state(busy_rank.pid)})"
        os.kill(busy_rank.pid, signal.SIGCONT)
        assert wait_until(lambda: proc_state(busy_rank.pid) != "T", 5.0)
    assert failed == [], f"samples lost while the rank was being stopped: {failed}"
