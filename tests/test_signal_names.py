"""The signal names the one signalling program accepts (actions/signal_processes.py's SIGNALS),
with SIGTTIN, SIGTTOU, SIGALRM, SIGPIPE, SIGSEGV and SIGBUS among them, each checked on real
processes with real signals. Before, only SIGKILL, SIGTERM, SIGSTOP, SIGCONT, SIGINT, SIGQUIT,
SIGHUP, SIGUSR1, SIGUSR2, SIGABRT and SIGTSTP could be sent, though the program's stop check
already knew SIGTTIN and SIGTTOU.

SIGTTIN and SIGTTOU are stop signals: they stop a process of a process group that is not
orphaned (state T, reported `stopped`, this run's freeze, resumed by the rollback), and the
kernel discards them for one whose group is orphaned (a session of its own), which is reported
not stopped with that reason. SIGALRM, SIGPIPE, SIGSEGV and SIGBUS end a process (the last two
dumping core): the terminate primitive sees the exit, the outcome names the signal, and the
frozen-target release is asked first as for SIGTERM. A misspelled name ("SIGALARM") is refused,
naming the accepted list, and nothing is signalled. Every process started here is gone after
each test.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proc_helpers import finish, proc_state, unique, wait_until

from chaosgpu import faultlog
from chaosgpu.arguments import InvalidArgument
from chaosgpu.errors import ActivityError
from chaosgpu.intarget import load, program_path
from chaosgpu.job import actions as job_actions
from chaosgpu.process import actions as process_actions
from chaosgpu.process import terminate as typed_terminate
from chaosgpu.scope import resolve_scope_detail

program = load("actions", "signal_processes")
NEW_STOPS = ["SIGTTIN", "SIGTTOU"]
NEW_FATAL = ["SIGALRM", "SIGPIPE", "SIGSEGV", "SIGBUS"]
# Writes one line to `caught` (its argv[1]) for every signal it can catch, so a test can tell
# that none reached it.
CATCHER = """
import signal, sys, time
caught = open(sys.argv[1], "a")
def note(signum, _frame):
    caught.write(signal.Signals(signum).name + "\\n")
    caught.flush()
for signum in range(1, 32):
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, note)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture(autouse=True)
def _fresh_faultlog() -> Iterator[None]:
    faultlog.clear()
    yield
    faultlog.clear()


def _default_dispositions() -> None:
    """In the child before exec: every signal's default action (an ignored disposition is
    inherited across exec, as from nohup or a script without job control), and no core file
    (SIGSEGV, SIGBUS, SIGQUIT and SIGABRT dump core by default)."""
    for signum in range(1, 32):
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _sleeper(tag: str, cwd: Path, own_session: bool = False, rank: bool = False,
             ) -> "subprocess.Popen[bytes]":
    """`sleep 300` tagged `tag` (and rank 0 of job `tag` with `rank`), default dispositions, in
    a process group of its own inside this test's session (not orphaned: its parent, this test,
    is in another group of the same session, so SIGTSTP, SIGTTIN and SIGTTOU stop it), or with
    `own_session` in a session of its own (an orphaned group: the kernel discards them)."""
    env = dict(os.environ, CHAOSGPU_TAG=tag)
    if rank:
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29927",
                   CHAOSGPU_JOB=tag)
    proc = subprocess.Popen(["sleep", "300"], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            process_group=None if own_session else 0,
                            start_new_session=own_session, preexec_fn=_default_dispositions)
    assert wait_until(lambda: proc_state(proc.pid) == "S", 5)  # exec'd and asleep
    return proc


def _target(pid: int) -> dict[str, int]:
    stat = program._read_stat(pid)
    assert stat is not None
    return {"pid": pid, "starttime": stat[3]}



# -- the names and what the program makes of them ----------------------------------------------

def test_the_new_names_are_sent_and_classified_by_their_default_action() -> None:
    """SIGTTIN and SIGTTOU are stop signals, SIGALRM, SIGPIPE, SIGSEGV and SIGBUS end a process;
    every caller's choice of signals is the program's own list."""
    for name in NEW_STOPS + NEW_FATAL:
        assert name in program.SIGNALS
    assert set(program.STOP_SIGNALS) <= set(program.SIGNALS)  # every stop signal can be sent
    for name in NEW_STOPS:
        signum = program.parse_signal(name)
        assert program.stops_process(signum) and not program.ends_process(signum)
        assert name not in program.FATAL_SIGNALS and name in process_actions.STOP_KINDS
    for name in NEW_FATAL:
        signum = program.parse_signal(name)
        assert program.ends_process(signum) and not program.stops_process(signum)
        assert name in program.FATAL_SIGNALS
    assert job_actions.SIGNALS == tuple(program.SIGNALS)
    for name in NEW_STOPS + NEW_FATAL:
        assert job_actions.SIGNAL_NAME.accepts(name), name  # kill_rank, kill_rank_in_pod
        for spelled in (name, name[3:], name.lower(), name[3:].lower()):
            assert process_actions.SIGNAL.accepts(spelled), spelled  # signal_processes
            assert program.parse_signal(spelled) == getattr(signal, name)


# -- SIGTTIN and SIGTTOU: stop signals, confirmed stopped ---------------------------------------

@pytest.mark.parametrize("name", NEW_STOPS)
def test_sigttin_and_sigttou_stop_a_process_whose_group_is_not_orphaned(
        name: str, tmp_path: Path) -> None:
    """Seen stopped (state T) and reported `stopped`; recorded as this run's freeze under the
    signal's name, which resume_processes undoes."""
    tag = unique(name.lower())
    proc = _sleeper(tag, tmp_path)
    try:
        scope = {"tag": tag}
        assert wait_until(lambda: len(resolve_scope_detail(scope)["processes"]) == 1)
        report = process_actions.signal_processes(scope, signal=name, wait_stopped_s=5)
        (result,) = report["results"]
        assert report["signal"] == name and result["result"] == "sent", report
        assert result["stopped"] is True and "not_stopped" not in result, report
        assert (report["stopped"], report["not_stopped"]) == (1, 0), report
        assert proc_state(proc.pid) == "T"
        assert [(f["kind"], f["pid"]) for f in faultlog.recent()] == [(name, proc.pid)]
        resumed = process_actions.resume_processes(scope)
        assert [r["pid"] for r in resumed["results"] if r["result"] == "sent"] == [proc.pid]
        assert wait_until(lambda: proc_state(proc.pid) in ("S", "R"))
    finally:
        finish(proc)


@pytest.mark.parametrize("name", NEW_STOPS)
def test_the_program_reports_sigttin_and_sigttou_stopped(name: str, tmp_path: Path) -> None:
    """The program itself (what runs inside a pod): its signal_targets and its command line
    watch the target until it is stopped."""
    proc = _sleeper(unique("prog"), tmp_path)
    try:
        report = program.signal_targets([_target(proc.pid)], name, wait_stopped_s=5)
        assert report["results"][0]["stopped"] is True and proc_state(proc.pid) == "T", report
        os.kill(proc.pid, signal.SIGCONT)
        assert wait_until(lambda: proc_state(proc.pid) in ("S", "R"))
        done = subprocess.run([sys.executable, str(program_path("actions", "signal_processes")),
                               name[3:].lower(), json.dumps([_target(proc.pid)])],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(done.stdout)
        assert report["signal"] == name and report["results"][0]["stopped"] is True, report
        assert proc_state(proc.pid) == "T"
    finally:
        finish(proc)


@pytest.mark.parametrize("name", NEW_STOPS)
def test_sigttin_and_sigttou_to_an_orphaned_group_are_reported_not_stopped(
        name: str, tmp_path: Path) -> None:
    """A process in a session of its own is in an orphaned process group: the kernel discards
    SIGTTIN and SIGTTOU. The program says so, and signal_processes fails (none stopped)."""
    tag = unique("orphan-" + name.lower())
    proc = _sleeper(tag, tmp_path, own_session=True)
    try:
        report = program.signal_targets([_target(proc.pid)], name, wait_stopped_s=0.5)
        (result,) = report["results"]
        assert result["result"] == "sent" and result["stopped"] is False, report
        assert result["state_after"] in ("S", "R"), report
        assert "is orphaned" in result["not_stopped"], report
        assert f"the kernel discards {name} for it" in result["not_stopped"], report
        assert (report["stopped"], report["not_stopped"]) == (0, 1), report
        scope = {"tag": tag}
        assert wait_until(lambda: len(resolve_scope_detail(scope)["processes"]) == 1)
        with pytest.raises(ActivityError, match="none was seen stopped") as raised:
            process_actions.signal_processes(scope, signal=name, wait_stopped_s=0.5)
        assert f"PID {proc.pid}" in str(raised.value)
        assert f"the kernel discards {name} for it" in str(raised.value)
        assert proc_state(proc.pid) in ("S", "R")  # running, as the failure says
    finally:
        finish(proc)


def test_kill_rank_stops_a_rank_with_sigttou_and_resume_rank_resumes_it(tmp_path: Path) -> None:
    tag = unique("rank-ttou")
    proc = _sleeper(tag, tmp_path, rank=True)
    try:
        out = job_actions.kill_rank(rank=0, tag=tag, signal="SIGTTOU", wait_s=0)
        assert out["pid"] == proc.pid and out["stopped"] is True, out
        assert proc_state(proc.pid) == "T"
        assert [(f["kind"], f["pid"]) for f in faultlog.recent()] == [("SIGTTOU", proc.pid)]
        resumed = job_actions.resume_rank(rank="any", tag=tag)
        assert resumed["result"] == "sent" and resumed["pid"] == proc.pid, resumed
        assert wait_until(lambda: proc_state(proc.pid) in ("S", "R"))
    finally:
        finish(proc)


# -- SIGALRM, SIGPIPE, SIGSEGV, SIGBUS: they end a process ---------------------------------------

def _via_program(targets: list[dict[str, int]], name: str, until: str) -> dict[str, Any]:
    (outcome,) = program.terminate(targets, [name], grace_s=5.0, deadline_s=10.0, until=until)
    return {"result": outcome["result"], "exited_on": outcome.get("exited_on"),
            "signals": [s["signal"] for s in outcome["signals"]],
            "reaped": outcome.get("reaped")}


def _via_package(targets: list[dict[str, int]], name: str, until: str) -> dict[str, Any]:
    (outcome,) = typed_terminate.terminate(
        [typed_terminate.Target(t["pid"], t["starttime"]) for t in targets], [name], 5.0, 10.0,
        typed_terminate.Rules(), until=until)
    return {"result": outcome.result, "exited_on": outcome.exited_on,
            "signals": [s.signal for s in outcome.signals], "reaped": outcome.reaped}


@pytest.mark.parametrize("via", [_via_program, _via_package], ids=["program", "package"])
@pytest.mark.parametrize("until", ["exit", "reaped"])
@pytest.mark.parametrize("name", NEW_FATAL)
def test_sigalrm_sigpipe_sigsegv_and_sigbus_end_a_process(
        name: str, until: str, via: Any, tmp_path: Path) -> None:
    proc = _sleeper(unique("fatal"), tmp_path)
    reaper = None
    try:
        if until == "reaped":  # this test is the parent: it reaps the target as it dies
            reaper = threading.Thread(target=proc.wait, daemon=True)
            reaper.start()
        out = via([_target(proc.pid)], name, until)
        assert out["result"] == "exited" and out["exited_on"] == name, out
        assert out["signals"] == [name], out
        if until == "reaped":
            assert out["reaped"] is True, out
        assert proc.wait(timeout=5) == -getattr(signal, name)
        assert list(tmp_path.iterdir()) == []  # no core file left behind
    finally:
        if reaper is not None:
            reaper.join(timeout=10)
        finish(proc)


@pytest.mark.parametrize("name", NEW_STOPS + NEW_FATAL)
def test_the_frozen_target_release_is_asked_before_each_fatal_signal_only(
        name: str, tmp_path: Path) -> None:
    """The caller's `release` (chaosgpu's freezer's, on the node) gets the targets before a
    signal that ends a process, as before SIGTERM, so none stays pending in a frozen cgroup;
    never before a stop signal, which leaves a frozen target frozen."""
    proc = _sleeper(unique("release"), tmp_path)
    asked: list[tuple[float, list[dict[str, Any]]]] = []

    def release(targets: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
        asked.append((time.time(), targets))
        return {}  # none of them frozen

    try:
        target = _target(proc.pid)
        report = program.signal_targets([target], name, release=release, wait_stopped_s=5)
        (result,) = report["results"]
        assert result["result"] == "sent", report
        if name in NEW_FATAL:
            assert [targets for _at, targets in asked] == [[target]]
            assert asked[0][0] <= result["sent_at"]
            assert proc.wait(timeout=5) == -getattr(signal, name)
        else:
            assert asked == [] and result["stopped"] is True, report
    finally:
        finish(proc)


@pytest.mark.parametrize("name", ["SIGSEGV", "SIGBUS"])
def test_kill_rank_crashes_a_rank_with_sigsegv_or_sigbus(name: str, tmp_path: Path) -> None:
    """A rank dying as a segfault or a bus error does: the rank ends on that very signal, and
    the fault log records it under the signal's name."""
    tag = unique("rank-crash")
    proc = _sleeper(tag, tmp_path, rank=True)
    try:
        out = job_actions.kill_rank(rank=0, tag=tag, signal=name)
        assert out["result"] == "sent" and out["signal"] == name and out["pid"] == proc.pid, out
        assert proc.wait(timeout=5) == -getattr(signal, name)
        assert [(f["kind"], f["pid"]) for f in faultlog.recent()] == [(name, proc.pid)]
    finally:
        finish(proc)


def test_signal_processes_sends_sigpipe_and_waits_for_the_exit(tmp_path: Path) -> None:
    tag = unique("pipe")
    proc = _sleeper(tag, tmp_path)
    try:
        scope = {"tag": tag}
        assert wait_until(lambda: len(resolve_scope_detail(scope)["processes"]) == 1)
        report = process_actions.signal_processes(scope, signal="pipe", wait_gone_s=5)
        assert report["signal"] == "SIGPIPE" and report["sent"] == 1, report
        assert report["wait"]["all_gone"] is True, report
        assert proc.wait(timeout=5) == -signal.SIGPIPE
    finally:
        finish(proc)


# -- a misspelled name is refused, and nothing is signalled ---------------------------------------

def test_a_misspelled_signal_is_refused_naming_the_list_and_nothing_is_signalled(
        tmp_path: Path) -> None:
    caught = tmp_path / "caught"
    tag = unique("typo")
    proc = subprocess.Popen([sys.executable, "-c", CATCHER, str(caught)],
                            env=dict(os.environ, CHAOSGPU_TAG=tag), stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, process_group=0)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        accepted = ", ".join(program.SIGNALS)
        assert "SIGALRM" in accepted and "SIGTTIN" in accepted
        target = _target(proc.pid)
        with pytest.raises(program.SignalInputError) as raised:
            program.signal_targets([target], "SIGALARM")
        assert str(raised.value) == (f"unsupported signal 'SIGALARM'; expected one of "
                                     f"{accepted} or '0' (check only)")
        with pytest.raises(program.SignalInputError, match="unsupported signal 'SIGSEGFAULT'"):
            program.terminate([target], ["SIGTERM", "SIGSEGFAULT"])  # one bad name: none sent
        with pytest.raises(program.SignalInputError, match="unsupported signal 'TTYIN'"):
            program.wait_stopped([target], 0.1, "TTYIN")
        done = subprocess.run([sys.executable, str(program_path("actions", "signal_processes")),
                               "SIGALARM", json.dumps([target])],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"unsupported signal 'SIGALARM'; expected one of {accepted}" \
            in json.loads(done.stdout)["error"]
        scope = {"tag": tag}
        assert wait_until(lambda: len(resolve_scope_detail(scope)["processes"]) == 1)
        with pytest.raises(InvalidArgument, match="unsupported signal 'SIGALARM'") as invalid:
            process_actions.signal_processes(scope, signal="SIGALARM")
        assert accepted in str(invalid.value)
        with pytest.raises(InvalidArgument, match="got 'SIGALARM'") as invalid:
            job_actions.kill_rank(rank=0, tag=tag, signal="SIGALARM")
        assert "'SIGALRM'" in str(invalid.value) and "'SIGBUS'" in str(invalid.value)
        time.sleep(0.2)
        assert proc.poll() is None and proc_state(proc.pid) in ("S", "R")
        assert not caught.exists() or caught.read_text() == ""  # no signal reached it
        assert faultlog.recent() == []
    finally:
        finish(proc)
