"""A stop signal sent is not a stop: signal_processes, freeze_processes, kill_rank and freeze_rank
watch each process sent SIGSTOP or SIGTSTP until /proc shows it stopped (state T), and fail,
saying why from /proc, when none stops (signal_processes) or any lives on running (a freeze).
Before, a SIGTSTP that the target ignored or handled, or that the kernel discarded because the
target's process group was orphaned (a session of its own, as chaosgpu's own workloads run),
and a SIGSTOP that a tracer attached to the target received in its place, were reported sent
and recorded as this run's freeze while the target ran on. Checked on real processes, a real
ptrace tracer and the signalling program's own command line; every process is gone afterwards.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proc_helpers import finish, proc_state, unique, wait_until

from chaosgpu import faultlog
from chaosgpu.arguments import InvalidArgument
from chaosgpu.errors import ActivityError
from chaosgpu.job import actions as job_actions
from chaosgpu.process import actions as process_actions
from chaosgpu.scope import resolve_scope_detail

PROGRAM = Path(__file__).resolve().parents[1] / "actions" / "signal_processes.py"
IGNORES_TSTP = "import signal, time\nsignal.signal(signal.SIGTSTP, signal.SIG_IGN)\n" \
               "print('ready', flush=True)\ntime.sleep(300)\n"
HANDLES_TSTP = "import signal, time\nsignal.signal(signal.SIGTSTP, lambda *a: None)\n" \
               "print('ready', flush=True)\ntime.sleep(300)\n"
PLAIN = "import time\nprint('ready', flush=True)\ntime.sleep(300)\n"
# A tracer that seizes its target (PTRACE_SEIZE: no stop on attach) and never waits for it: a
# signal the target receives stops it in a signal-delivery stop (state t) that only this tracer
# could pass on, as a debugger or a profiler attached at that moment would hold it.
TRACER = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(ctypes.c_long(0x4206), ctypes.c_int(int(sys.argv[1])), None, None) != 0:
    print("failed", ctypes.get_errno(), flush=True)
    sys.exit(1)
print("seized", flush=True)
time.sleep(300)
"""


@pytest.fixture(autouse=True)
def _fresh_faultlog() -> Iterator[None]:
    faultlog.clear()
    yield
    faultlog.clear()


def _start(code: str, tag: str, own_session: bool = False, rank: bool = False,
           ) -> "subprocess.Popen[str]":
    """A Python process tagged `tag` (and a rank of job `tag` with `rank`): in a process group
    of its own inside this test's session (not orphaned: SIGTSTP can stop it), or in a session
    of its own (an orphaned group: the kernel discards SIGTSTP for it)."""
    env = dict(os.environ, CHAOSGPU_TAG=tag)
    if rank:
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29921",
                   CHAOSGPU_JOB=tag)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True,
                            process_group=None if own_session else 0,
                            start_new_session=own_session)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc



def _tracer(pid: int) -> "subprocess.Popen[str]":
    tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(pid)], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True)
    assert tracer.stdout is not None
    line = tracer.stdout.readline().strip()
    if line != "seized":
        finish(tracer)
        pytest.skip(f"this machine does not let a process be traced here ({line})")
    return tracer


def _matched(scope: dict[str, object], count: int) -> bool:
    return wait_until(lambda: len(resolve_scope_detail(scope)["processes"]) == count)


@pytest.mark.parametrize(("code", "own_session", "why"), [
    (IGNORES_TSTP, False, "it ignores SIGTSTP"),
    (HANDLES_TSTP, False, "it handles SIGTSTP itself"),
    (PLAIN, True, "is orphaned"),
], ids=["ignored", "handled", "orphaned-group"])
def test_a_sigtstp_that_stops_nothing_fails_and_says_why(code: str, own_session: bool,
                                                          why: str) -> None:
    tag = unique("tstp-none")
    proc = _start(code, tag, own_session)
    try:
        assert _matched({"tag": tag}, 1)
        began = time.monotonic()
        with pytest.raises(ActivityError, match="none was seen stopped") as raised:
            process_actions.signal_processes({"tag": tag}, signal="SIGTSTP", wait_stopped_s=0.5)
        assert time.monotonic() - began < 10
        assert why in str(raised.value) and f"PID {proc.pid}" in str(raised.value)
        assert proc_state(proc.pid) in ("S", "R")  # running, as the failure says
        # A handled stop is recorded (its handler may stop the process: the rollback resumes
        # that); an ignored or discarded one is lost for good and is not (a later stop is
        # someone else's: tests/test_trial3_lost_stop.py). The rollback finds nothing to resume.
        recorded = [] if code != HANDLES_TSTP else [("SIGTSTP", proc.pid)]
        assert [(f["kind"], f["pid"]) for f in faultlog.recent()] == recorded
        process_actions.resume_processes({"tag": tag})
        assert proc_state(proc.pid) in ("S", "R")
    finally:
        finish(proc)


def test_a_stop_that_holds_for_some_is_reported_per_process_and_passes() -> None:
    """One process stops on SIGTSTP, one ignores it: the activity passes (something stopped),
    and each result says whether its process stopped and, for the other, why not."""
    tag = unique("tstp-some")
    stops, ignores = _start(PLAIN, tag), _start(IGNORES_TSTP, tag)
    try:
        assert _matched({"tag": tag}, 2)
        report = process_actions.signal_processes({"tag": tag}, signal="SIGTSTP",
                                                  wait_stopped_s=1.0)
        by_pid = {r["pid"]: r for r in report["results"]}
        assert by_pid[stops.pid]["stopped"] is True and proc_state(stops.pid) == "T"
        assert by_pid[ignores.pid]["stopped"] is False
        assert by_pid[ignores.pid]["not_stopped"] == "it ignores SIGTSTP"
        assert (report["stopped"], report["not_stopped"]) == (1, 1)
        process_actions.resume_processes({"tag": tag})
        assert wait_until(lambda: proc_state(stops.pid) in ("S", "R"))
    finally:
        finish(stops, ignores)


def test_a_freeze_a_tracer_holds_fails_and_names_the_tracer() -> None:
    """SIGSTOP goes to a tracer attached to the target first (state t, a signal-delivery
    stop), which may drop it: freeze_processes fails, naming the tracer's PID, instead of
    reporting a frozen process. The rollback's SIGCONT is harmless."""
    tag = unique("traced")
    proc = _start(PLAIN, tag)
    tracer = _tracer(proc.pid)
    try:
        assert _matched({"tag": tag}, 1)
        with pytest.raises(ActivityError, match=f"traced by PID {tracer.pid}") as raised:
            process_actions.freeze_processes({"tag": tag}, method="sigstop", deadline_s=0.5)
        assert "did not hold within 0.5 s" in str(raised.value)
        assert proc_state(proc.pid) == "t"  # held by the tracer, not stopped by the freeze
        assert [(f["kind"], f["pid"]) for f in faultlog.recent()] == [("SIGSTOP", proc.pid)]
    finally:
        finish(tracer, proc)


def test_kill_rank_sigtstp_on_a_rank_in_a_session_of_its_own_fails() -> None:
    """A rank started in a session of its own (as chaosgpu's workloads and many launchers start
    them) is in an orphaned process group: the kernel discards SIGTSTP. kill_rank says it will
    never stop the rank and fails, recording no freeze; before, it reported the rank stopped."""
    tag = unique("rank-orphan")
    proc = _start(PLAIN, tag, own_session=True, rank=True)
    try:
        with pytest.raises(ActivityError, match="will never stop it") as raised:
            job_actions.kill_rank(rank=0, tag=tag, signal="SIGTSTP", wait_s=0)
        assert "orphaned" in str(raised.value) and proc_state(proc.pid) in ("S", "R")
        # SIGSTOP cannot be discarded: freeze_rank stops the same rank, and says so.
        frozen = job_actions.freeze_rank(rank=0, tag=tag)
        assert frozen["stopped"] is True and proc_state(proc.pid) == "T", frozen
        job_actions.resume_rank(rank=0, tag=tag)
        assert wait_until(lambda: proc_state(proc.pid) in ("S", "R"))
    finally:
        finish(proc)


def test_freeze_rank_on_a_traced_rank_fails() -> None:
    tag = unique("rank-traced")
    proc = _start(PLAIN, tag, rank=True)
    tracer = _tracer(proc.pid)
    try:
        with pytest.raises(ActivityError, match=f"traced by PID {tracer.pid}"):
            job_actions.freeze_rank(rank=0, tag=tag)
    finally:
        finish(tracer, proc)


def test_the_program_s_command_line_watches_a_stop_and_refuses_bad_waits() -> None:
    """What kill_rank_in_pod and freeze_rank_in_pod run inside a pod: one stop signal is
    watched until its target stops (--wait-stopped-s, 5 s by default), each result says
    `stopped`; a bad wait, or one given with an escalation, is refused (exit 2), nothing sent."""
    ignores = _start(IGNORES_TSTP, unique("cli"))
    plain = _start(PLAIN, unique("cli"))
    try:
        def targets(*procs: "subprocess.Popen[str]") -> str:
            stat = [Path(f"/proc/{p.pid}/stat").read_text() for p in procs]
            return json.dumps([{"pid": p.pid, "starttime": int(s[s.rindex(")") + 2:].split()[19])}
                               for p, s in zip(procs, stat, strict=True)])

        def run(*args: str) -> tuple[int, dict[str, object]]:
            done = subprocess.run([sys.executable, str(PROGRAM), *args], capture_output=True,
                                  text=True, timeout=60)
            return done.returncode, json.loads(done.stdout)

        code, report = run("SIGTSTP", targets(ignores, plain), "--wait-stopped-s=0.5")
        assert code == 0 and (report["stopped"], report["not_stopped"]) == (1, 1), report
        results = {r["pid"]: r for r in report["results"]}  # type: ignore[attr-defined]
        assert results[plain.pid]["stopped"] is True and proc_state(plain.pid) == "T"
        assert results[ignores.pid]["not_stopped"] == "it ignores SIGTSTP"
        os.kill(plain.pid, signal.SIGCONT)
        code, report = run("SIGSTOP", targets(plain))  # the default wait
        assert code == 0 and report["results"][0]["stopped"] is True  # type: ignore[index]
        os.kill(plain.pid, signal.SIGCONT)
        assert wait_until(lambda: proc_state(plain.pid) in ("S", "R"))
        for bad in (["--wait-stopped-s=soon"], ["--wait-stopped-s=nan"],
                    ["--wait-stopped-s=-1"], ["--wait-stopped-s=1", "--deadline-s=2"]):
            code, report = run("SIGSTOP", targets(plain), *bad)
            assert code == 2 and "wait-stopped-s" in str(report["error"]).replace("_", "-"), \
                (bad, report)
            assert proc_state(plain.pid) in ("S", "R"), bad  # nothing was sent
    finally:
        finish(ignores, plain)


@pytest.mark.parametrize("bad", [0, -1, "5", None, float("nan")])
def test_a_bad_wait_stopped_s_is_refused_before_anything_is_sent(bad: object) -> None:
    tag = unique("bad-wait")
    proc = _start(PLAIN, tag)
    try:
        assert _matched({"tag": tag}, 1)
        with pytest.raises(InvalidArgument, match="wait_stopped_s"):
            process_actions.signal_processes({"tag": tag}, signal="SIGSTOP",
                                             wait_stopped_s=bad)  # type: ignore[arg-type]
        time.sleep(0.2)
        assert proc_state(proc.pid) in ("S", "R") and faultlog.recent() == []
    finally:
        finish(proc)
