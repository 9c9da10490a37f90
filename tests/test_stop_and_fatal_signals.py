"""Which signals stop a process and which end it, decided once by the signalling program and
checked against the kernel on real processes: every stop signal signal_processes sends (SIGTSTP,
SIGTTIN and SIGTTOU as well as SIGSTOP) is this run's freeze, which resume_processes undoes;
every signal whose default action ends a process (SIGUSR1, SIGUSR2, SIGALRM, SIGPIPE, SIGSEGV and
SIGBUS as well as SIGKILL and SIGTERM) lets its target out of chaosgpu's frozen v1 freezer group
first, where it would otherwise stay pending until a thaw; SIGCONT and the stop signals leave a
frozen target frozen."""

import os
import resource
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proc_helpers import alive, finish, proc_state, unique, wait_until

from chaosgpu import faultlog
from chaosgpu.intarget import load
from chaosgpu.process import actions as process_actions
from chaosgpu.process import freezer
from chaosgpu.scope import resolve_scope_detail

V1 = Path("/sys/fs/cgroup/freezer")
needs_v1_freezer = pytest.mark.skipif(
    os.geteuid() != 0 or not (V1 / "cgroup.procs").exists(),
    reason="needs root and the cgroup v1 freezer")
program = load("actions", "signal_processes")


@pytest.fixture(autouse=True)
def _fresh_faultlog() -> Iterator[None]:
    faultlog.clear()
    yield
    faultlog.clear()


def _sleeper(tag: str, cwd: Path | None = None) -> "subprocess.Popen[bytes]":
    """`sleep 300` in a process group of its own inside this test's session, default signal
    dispositions: its group is not orphaned (its parent, this test, is in another group of the
    same session), so the kernel lets SIGTSTP, SIGTTIN and SIGTTOU stop it. (A process in a
    session of its own, as chaosgpu's workloads are, is in an orphaned group: the kernel
    discards those three for it.)"""
    return subprocess.Popen(["sleep", "300"], env=dict(os.environ, CHAOSGPU_TAG=tag),
                            process_group=0, cwd=cwd, stdin=subprocess.DEVNULL,
                            preexec_fn=_default_dispositions)


def _default_dispositions() -> None:
    """In the child before exec: every signal's default action. An ignored disposition is
    inherited across exec: a test run started by nohup ignores SIGHUP, one started in the
    background of a script without job control SIGINT and SIGQUIT."""
    for signum in range(1, 32):
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)


def _finish(*procs: "subprocess.Popen[bytes]") -> None:
    """Thaw what is left of `procs`, kill and reap them."""
    freezer.thaw({p.pid for p in procs})
    finish(*procs)


# -- the rule, against the kernel ---------------------------------------------------------------

def test_which_signals_stop_or_end_a_process_is_what_the_kernel_does(tmp_path: Path) -> None:
    """Each standard signal, sent to a real process with default dispositions: it ends the
    process exactly when ends_process says so, stops it exactly when stops_process says so."""
    wrong = []
    for signum in range(1, 32):
        name = signal.Signals(signum).name
        proc = _sleeper(unique("rule"), cwd=tmp_path)
        try:
            resource.prlimit(proc.pid, resource.RLIMIT_CORE, (0, 0))  # no core file
            assert wait_until(lambda p=proc: proc_state(p.pid) == "S", 5)  # type: ignore[misc]
            os.kill(proc.pid, signum)
            try:
                code = proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                code = None
            ended = code == -signum
            stopped = code is None and proc_state(proc.pid) == "T"
            if (ended, stopped) != (program.ends_process(signum), program.stops_process(signum)):
                wrong.append(f"{name}: ended {ended}, stopped {stopped}")
        finally:
            _finish(proc)
    assert wrong == []
    assert set(program.STOP_SIGNALS) == {"SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU"}
    assert set(program.STOP_SIGNALS) <= set(program.SIGNALS)  # each can be sent
    assert not program.ends_process(0) and not program.stops_process(0)  # the null signal
    assert set(program.FATAL_SIGNALS) == set(program.SIGNALS) - set(program.STOP_SIGNALS) \
        - {"SIGCONT"}
    assert {"SIGALRM", "SIGPIPE", "SIGSEGV", "SIGBUS"} <= set(program.FATAL_SIGNALS)


# -- every stop signal is this run's freeze (SIGSTOP, and SIGTSTP, SIGTTIN, SIGTTOU alike) --------

@pytest.mark.parametrize("stop", ["SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU"])
def test_a_stop_through_signal_processes_is_resumed_and_a_foreign_stop_is_left(stop: str) -> None:
    tag = unique("stop-" + stop.lower())
    ours, theirs = _sleeper(tag), _sleeper(tag)
    try:
        scope = {"tag": tag}
        assert wait_until(lambda: len(resolve_scope_detail(scope)["processes"]) == 2)
        os.kill(theirs.pid, signal.Signals[stop])  # stopped by someone else before the fault
        assert wait_until(lambda: proc_state(theirs.pid) == "T")
        report = process_actions.signal_processes(scope, signal=stop)
        assert report["signal"] == stop and report["sent"] == 2, report
        assert [e["pid"] for e in report["already_stopped"]] == [theirs.pid], report
        assert f"before this {stop}" in report["already_stopped"][0]["reason"]
        assert wait_until(lambda: proc_state(ours.pid) == "T")
        assert [(f["kind"], f["pid"]) for f in faultlog.recent()] == [(stop, ours.pid)]
        resumed = process_actions.resume_processes(scope)
        assert [r["pid"] for r in resumed["results"] if r["result"] == "sent"] == [ours.pid]
        assert wait_until(lambda: proc_state(ours.pid) in ("S", "R"))
        assert [e["pid"] for e in resumed["left_stopped"]] == [theirs.pid], resumed
        time.sleep(0.1)
        assert proc_state(theirs.pid) == "T"  # never resumed: not this run's stop
        # A SIGCONT through signal_processes ends this run's stop: a later resume leaves
        # alone a stop that came after it.
        process_actions.signal_processes({"pids": [ours.pid]}, signal=stop)
        assert wait_until(lambda: proc_state(ours.pid) == "T")
        process_actions.signal_processes({"pids": [ours.pid]}, signal="SIGCONT")
        assert wait_until(lambda: proc_state(ours.pid) in ("S", "R"))
        os.kill(ours.pid, signal.SIGSTOP)  # someone else's, after that
        assert wait_until(lambda: proc_state(ours.pid) == "T")
        again = process_actions.resume_processes(scope)
        assert again["sent"] == 0 and proc_state(ours.pid) == "T", again
    finally:
        _finish(ours, theirs)


def _rank(tag: str) -> "subprocess.Popen[bytes]":
    """A rank-like `sleep` (rank 0 of job `tag`, as the census finds jobs by their ranks'
    environment), in a process group of its own inside this test's session (see _sleeper)."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29919", CHAOSGPU_TAG=tag, CHAOSGPU_JOB=tag)
    return subprocess.Popen(["sleep", "300"], env=env, process_group=0,
                            stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("rank", [0, "any"])
def test_resume_rank_resumes_a_rank_this_run_stopped_with_sigtstp(rank: object) -> None:
    """kill_rank(signal="SIGTSTP") stops the rank and is recorded under the signal's name;
    resume_rank took only SIGSTOP and the freezer for this run's freezes ("not frozen by this
    run", or "none frozen" for "any") and left the rank stopped."""
    from chaosgpu.job import actions as job_actions

    tag = unique("rank-tstp")
    proc = _rank(tag)
    try:
        assert wait_until(lambda: proc_state(proc.pid) == "S")
        stopped = job_actions.kill_rank(rank=0, tag=tag, signal="SIGTSTP", wait_s=0)
        assert stopped["result"] == "sent" and stopped["pid"] == proc.pid, stopped
        assert wait_until(lambda: proc_state(proc.pid) == "T")
        assert [(f["kind"], f["pid"]) for f in faultlog.recent()] == [("SIGTSTP", proc.pid)]
        resumed = job_actions.resume_rank(rank=rank, tag=tag)
        assert resumed["result"] == "sent" and resumed["pid"] == proc.pid, resumed
        assert wait_until(lambda: proc_state(proc.pid) in ("S", "R"))
    finally:
        _finish(proc)


def test_every_stop_signal_reads_as_a_freeze_in_the_report() -> None:
    """The fault log records a stop by signal under the signal's name: the report words each as
    it words SIGSTOP (SIGTSTP read as its bare name)."""
    from chaosgpu.report.events import describe_fault

    for name in program.STOP_SIGNALS:
        fault = {"kind": name, "activity": "stop-rank", "func": "kill_rank"}
        assert describe_fault(fault) == f"freeze ({name}) by 'stop-rank' (kill_rank)"


# -- every signal that ends a process lets its target out of chaosgpu's freezer ------------------

@needs_v1_freezer
@pytest.mark.parametrize("name", ["SIGUSR1", "SIGUSR2", "SIGALRM", "SIGPIPE", "SIGSEGV",
                                  "SIGBUS"])
def test_a_signal_that_ends_a_process_lets_its_target_out_of_the_freeze(name: str,
                                                                        tmp_path: Path) -> None:
    tag = unique("fatal-usr")
    proc = _sleeper(tag, cwd=tmp_path)
    try:
        resource.prlimit(proc.pid, resource.RLIMIT_CORE, (0, 0))  # SIGSEGV, SIGBUS: no core
        scope = {"tag": tag}
        assert wait_until(lambda: resolve_scope_detail(scope)["processes"])
        frozen = process_actions.freeze_processes(scope, method="freezer-v1")
        assert frozen["frozen"] == [proc.pid] and freezer.frozen_now(proc.pid)
        # A stop signal and SIGCONT do not end it: it is left in the freeze, where they stay
        # pending (the SIGCONT discards the pending stop signals: a process stopped once let
        # out would act on no signal but SIGKILL until continued). A short wait_stopped_s
        # spares the 5 s watch of a stop that cannot land while the target is frozen.
        for harmless in ("SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGCONT"):
            left = process_actions.signal_processes(scope, signal=harmless, wait_stopped_s=0.2)
            assert "released_from" not in left["results"][0], left
            assert freezer.frozen_now(proc.pid) and alive(proc.pid)
        report = process_actions.signal_processes(scope, signal=name, wait_gone_s=5)
        (result,) = report["results"]
        assert result["released_from"]["cgroup"] == frozen["cgroup"], report
        assert report["wait"]["all_gone"] is True, report
        assert proc.wait(timeout=5) == -getattr(signal, name)
        assert not Path(frozen["cgroup"]).exists()
    finally:
        _finish(proc)
