"""Where a thread waits, read from its source (chaosgpu.job.stacks.classify), and what counts as
its stack moving (signature, describe_move), on real py-spy samples of small Python processes
started here: a line near a collective is not the collective (a rank sleeping right after
`all_reduce(t)`, or after destroy_process_group, waits in nothing), a poll loop is read from
the loop that encloses the line (`while not work.is_completed():`, or `if work.is_completed():
break` in its body) and its poll counter is no progress, and a call spread over several lines is
one statement. The collective-named calls are C functions under those names (time.sleep, len,
an iterator's __next__), so the innermost Python frame is the user's own, as with torch's C++
collectives and Work.is_completed()."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_helpers import alive

from chaosgpu.job import stacks
from chaosgpu.job.stacks import Frame, SourceLines, StackSample, ThreadStack

pytestmark = pytest.mark.skipif(stacks.py_spy_path() is None, reason="py-spy is not installed")

SLEEP_AFTER_COLLECTIVE = """\
import time
all_reduce = len


def main():
    t = [1.0]
    print("ready", flush=True)
    for step in range(1000):
        all_reduce(t)
        time.sleep(60)  # HERE


main()
"""

SLEEP_AFTER_DESTROY = """\
import time
all_reduce = len
destroy_process_group = len


def main():
    t = [1.0]
    print("ready", flush=True)
    for step in range(3):
        all_reduce(t)
        step += 0
    destroy_process_group(t)
    time.sleep(60)  # HERE


main()
"""

CHECK_WITHOUT_BREAK = """\
import time
import types
all_reduce = len
work = types.SimpleNamespace(is_completed=bool)


def main():
    done = 0
    print("ready", flush=True)
    for step in range(1000):
        all_reduce([step])
        if work.is_completed():
            done += 1
        time.sleep(60)  # HERE


main()
"""

#: `work.is_completed()` returns False `K` times, then True (K from argv; 0: never True).
POLL_HEAD = """\
import itertools
import sys
import time
import types

K = int(sys.argv[1])
answers = itertools.cycle([False] * K + [True]) if K else itertools.repeat(False)
work = types.SimpleNamespace(is_completed=answers.__next__)
"""

# the driver every poll-loop script ends with: step(n) for ever
POLL_MAIN = """

def main():
    print("ready", flush=True)
    for n in range(10**6):
        step(n)


main()
"""

POLL_WHILE = POLL_HEAD + """

def step(n):
    polls = 0
    while not work.is_completed():  # POLL
        polls += 1
        time.sleep(0.02)  # HERE
    return polls
""" + POLL_MAIN

POLL_WHILE_TRUE = POLL_HEAD + """

def step(n):
    polls = 0
    while True:
        if work.is_completed():  # POLL
            break
        polls += 1
        time.sleep(0.02)  # HERE
""" + POLL_MAIN

POLL_FOR = POLL_HEAD + """

def step(n):
    for polls in range(10**9):
        if n < 0:
            continue
        if work.is_completed(): break  # POLL
        time.sleep(0.02)  # HERE
""" + POLL_MAIN

MULTI_LINE_CALL = """\
import time
all_reduce = time.sleep


def main():
    x = 1
    print("ready", flush=True)
    all_reduce(  # FIRST
        60,
    )  # LAST
    time.sleep(0)


main()
"""

MULTI_LINE_CHAIN = """\
import time
import types
dist = types.SimpleNamespace(all_reduce=time.sleep)


def main():
    x = 1
    print("ready", flush=True)
    x = (dist  # FIRST
         .all_reduce(60))  # LAST
    time.sleep(0)


main()
"""


def _line(script: str, marker: str) -> int:
    return next(i for i, text in enumerate(script.splitlines(), 1) if f"# {marker}" in text)


class Running:
    """A small Python process started from `script` (its source file in `folder`), killed and
    reaped at the end."""

    def __init__(self, folder: Path, script: str, *args: str) -> None:
        self.path = folder / f"script_{abs(hash(script)) % 10**8}.py"
        self.path.write_text(script)
        self.proc = subprocess.Popen([sys.executable, str(self.path), *args],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def sample(self) -> StackSample:
        found = stacks.take_samples([self.proc.pid], timeout_s=20.0)[self.proc.pid]
        assert found.error is None, found.error
        return found

    def sample_at(self, *lines: int, timeout_s: float = 30.0) -> StackSample:
        """A sample whose innermost frame runs one of `lines` of the script."""
        deadline = time.monotonic() + timeout_s
        seen = []
        while time.monotonic() < deadline:
            found = self.sample()
            inner = found.main_thread()
            if inner is not None and inner.frames[0].line in lines:
                return found
            seen.append(inner.frames[0].where() if inner is not None else None)
            time.sleep(0.05)
        raise AssertionError(f"never sampled at lines {lines}: {seen[-5:]}")

    def stop(self) -> None:
        self.proc.kill()
        assert self.proc.wait(timeout=20) == -signal.SIGKILL
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        assert not alive(self.proc.pid)  # ours, killed and reaped: nothing left


@pytest.fixture
def start(tmp_path: Path):  # type: ignore[no-untyped-def]
    started: list[Running] = []

    def run(script: str, *args: str) -> Running:
        started.append(Running(tmp_path, script, *args))
        return started[-1]

    try:
        yield run
    finally:
        for one in started:
            one.stop()


def _signature(sample: StackSample, site: stacks.Site | None) -> tuple[object, ...]:
    """The signature as chaosgpu.job.verdict takes it."""
    return stacks.signature(sample, {site.thread} if site is not None and site.thread
                            else {"MainThread"}, site)


#: the collective and the sleep on one line: a sample gives the line, not which of them runs
SLEEP_ON_THE_COLLECTIVES_LINE = SLEEP_AFTER_COLLECTIVE.replace(
    "        all_reduce(t)\n        time.sleep(60)  # HERE",
    "        all_reduce(t); time.sleep(60)  # HERE")


@pytest.mark.parametrize("script", [SLEEP_AFTER_COLLECTIVE, SLEEP_AFTER_DESTROY,
                                    CHECK_WITHOUT_BREAK, SLEEP_ON_THE_COLLECTIVES_LINE],
                         ids=["sleep-after-all_reduce", "sleep-after-destroy",
                              "is_completed-without-break", "sleep-on-all_reduce's-line"])
def test_a_line_near_a_collective_is_no_waiting_site(start, script: str) -> None:  # type: ignore[no-untyped-def]
    """A rank sleeping right after a line that calls all_reduce (or three lines below one,
    after destroy_process_group; or in a training loop that checks a work without leaving the
    loop on it) waits in nothing: no site, and its locals still count."""
    proc = start(script)
    sample = proc.sample_at(_line(script, "HERE"))
    assert stacks.classify(sample, SourceLines()) is None, stacks.render(sample)
    inner = sample.main_thread()
    assert inner is not None and inner.frames[0].locals  # they count: no poll loop
    assert _signature(sample, None) == stacks.signature(sample, {"MainThread"})


@pytest.mark.parametrize("script", [POLL_WHILE, POLL_WHILE_TRUE, POLL_FOR],
                         ids=["while-not-is_completed", "while-true-if-break",
                              "for-if-break-one-line"])
def test_a_counting_poll_loop_is_one_site_and_its_counter_no_progress(start, script: str) -> None:  # type: ignore[no-untyped-def]
    """A rank polling a work that never completes, counting its polls: every sample, on
    whichever line of the loop it lands, reads the same site (a wait on is_completed(), at
    the poll's line, `loop` set) and the same signature, while the counter in its frame moves;
    without the poll loop known (no site given) the same samples differ."""
    proc = start(script, "0")
    poll = _line(script, "POLL")
    samples = [proc.sample_at(_line(script, "HERE"))]
    for _ in range(6):
        time.sleep(0.2)
        samples.append(proc.sample())
    sites = [stacks.classify(sample, SourceLines()) for sample in samples]
    for sample, site in zip(samples, sites, strict=True):
        assert site is not None, stacks.render(sample)
        assert (site.kind, site.what, site.loop) == ("wait", "is_completed()", poll), site
        assert site.frame.endswith(f".py:{poll} step") and "is_completed()" in (site.source or "")
        assert site == sites[0]
    counters = [dict(s.main_thread().frames[0].locals).get("polls")  # type: ignore[union-attr]
                for s in samples]
    assert len(set(counters)) > 1, counters  # the poll counter moved meanwhile
    assert len({_signature(s, site) for s, site in zip(samples, sites, strict=True)}) == 1
    assert len({stacks.signature(s, {"MainThread"}) for s in samples}) > 1


def test_a_poll_loop_left_or_an_outer_step_counter_is_progress(start) -> None:  # type: ignore[no-untyped-def]
    """A poll loop whose work completes every 15 polls (0.3 s): samples in the loop at
    different steps differ by the caller's step counter; a sample out of the loop differs from
    one in it, and describe_move says which poll loop was left."""
    proc = start(POLL_WHILE, "15")
    poll = _line(POLL_WHILE, "POLL")
    first = proc.sample_at(_line(POLL_WHILE, "HERE"))
    site = stacks.classify(first, SourceLines())
    assert site is not None and site.loop == poll
    time.sleep(1.0)
    later = proc.sample_at(_line(POLL_WHILE, "HERE"))
    site_later = stacks.classify(later, SourceLines())
    before, after = _signature(first, site), _signature(later, site_later)
    assert before != after
    thread = first.main_thread()
    assert thread is not None
    assert stacks.describe_move(before, after).startswith(f"thread {thread.tid}: in main, "), \
        stacks.describe_move(before, after)
    # the same thread out of the loop (at its `return polls`)
    out = StackSample(first.pid, first.taken_at, [ThreadStack(
        thread.tid, thread.name,
        [Frame("step", thread.frames[0].filename, poll + 3, (("polls", "15"),)),
         *thread.frames[1:]])])
    assert stacks.classify(out, SourceLines()) is None
    moved = stacks.describe_move(before, _signature(out, None))
    assert before != _signature(out, None) and f"poll loop at line {poll}" in moved, moved


@pytest.mark.parametrize("script", [MULTI_LINE_CALL, MULTI_LINE_CHAIN],
                         ids=["call-over-three-lines", "method-chain-over-two-lines"])
def test_a_call_over_several_lines_is_one_statement(start, script: str) -> None:  # type: ignore[no-untyped-def]
    """A rank blocked in a collective-named call written over several lines: the real sample
    reads the collective; so do samples recorded at each line of the statement (which line a
    Python reports differs between versions: the first, the callee's, the last); the line
    after the statement does not."""
    proc = start(script)
    first, last = _line(script, "FIRST"), _line(script, "LAST")
    sample = proc.sample_at(*range(first, last + 1))
    site = stacks.classify(sample, SourceLines())
    assert site is not None and (site.kind, site.what, site.loop) == ("collective", "all_reduce",
                                                                       None), site
    assert "all_reduce(" in (site.source or "") and "60" in (site.source or ""), site
    thread = sample.main_thread()
    assert thread is not None
    for number in range(first, last + 2):
        recorded = StackSample(os.getpid(), time.time(), [ThreadStack(
            thread.tid, thread.name,
            [Frame("main", str(proc.path), number, thread.frames[0].locals),
             *thread.frames[1:]])])
        found = stacks.classify(recorded, SourceLines())
        if number <= last:
            assert found is not None and found.what == "all_reduce", (number, found)
        else:
            assert found is None, (number, found)


def test_a_file_that_cannot_be_parsed_is_read_at_its_innermost_line(tmp_path: Path) -> None:
    """Source this Python cannot parse (a newer syntax): the innermost line alone is read, as
    before; nothing nearby."""
    path = tmp_path / "broken.py"
    path.write_text("def f(:\n    work.wait()\n    time.sleep(1)\n")
    for line, expected in ((2, ".wait()"), (3, None)):
        sample = StackSample(os.getpid(), time.time(), [ThreadStack(
            os.getpid(), "MainThread", [Frame("f", str(path), line)])])
        found = stacks.classify(sample, SourceLines())
        assert (found.what if found is not None else None) == expected, (line, found)


def test_without_thread_names_the_main_thread_is_told_by_its_id() -> None:
    """py-spy --nonblocking names no thread: "MainThread" is then the thread whose id is the
    process's, so a background poller's counter (a heartbeat, a watchdog) is no progress of a
    rank whose main thread stays put; the site's thread is found by its id too. (Recorded
    samples: the rule over thread ids, not py-spy's output.)"""
    def sample(beats: int) -> StackSample:
        main = ThreadStack(4242, None, [Frame("wait", "/job/train.py", 9),
                                        Frame("main", "/job/train.py", 20, (("step", "7"),))])
        poller = ThreadStack(4250, None, [Frame("beat", "/job/train.py", 30,
                                                (("beats", str(beats)),))])
        return StackSample(4242, 0.0, [poller, main])

    before = stacks.signature(sample(1), {"MainThread"})
    after = stacks.signature(sample(2), {"MainThread"})
    assert before == after and [tid for tid, _ in after] == [4242], after
    assert stacks.signature(sample(1), None) != stacks.signature(sample(2), None)


POLL_FUTURE_DONE = POLL_HEAD.replace("work = types.SimpleNamespace(is_completed=",
                                     "fut = types.SimpleNamespace(done=") + """

def step(n):
    polls = 0
    while not fut.done():  # POLL
        polls += 1
        time.sleep(0.02)  # HERE
""" + POLL_MAIN


def test_a_future_polled_with_done_is_a_poll_loop(start) -> None:  # type: ignore[no-untyped-def]
    """`while not fut.done(): polls += 1; sleep` (an async collective's future) is the same
    poll loop as is_completed(): one site, and its counter no progress (outside trial: a
    deadlock polled so read running, 'polls 1129 -> 1191')."""
    proc = start(POLL_FUTURE_DONE, "0")
    samples = [proc.sample_at(_line(POLL_FUTURE_DONE, "HERE"))]
    for _ in range(4):
        time.sleep(0.2)
        samples.append(proc.sample())
    sites = [stacks.classify(sample, SourceLines()) for sample in samples]
    assert all(site is not None and (site.kind, site.what) == ("wait", "done()")
               for site in sites), sites
    assert len({_signature(s, site) for s, site in zip(samples, sites, strict=True)}) == 1
