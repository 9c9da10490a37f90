"""A stop signal that is lost for good is not recorded as this run's freeze, so the rollback's
resume_processes leaves a later stop by someone else as found (docs/faults.md, "Freezing").

SIGTSTP to a process that ignores it, or to one in an orphaned process group (a session of its
own: the kernel discards it), never stops that process. Before, signal_processes recorded it as
this run's freeze all the same, and when an operator stopped the process afterwards, the
rollback's resume_processes sent SIGCONT and let it run. SIGSTOP and a SIGTSTP that stops its
target are recorded as before (tests/test_stop_confirmed.py).

Real processes (sleep, its SIGTSTP ignored through `trap "" TSTP`, which survives exec, or in a
session of its own), real signals; all gone afterwards."""

import os
import signal
import subprocess
import time

import pytest
from proc_helpers import alive, proc_state, unique, wait_until

from chaosgpu.errors import ActivityError
from chaosgpu.process import actions


def _start(how: str, tag: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CHAOSGPU_TAG": tag}
    if how == "ignored":
        return subprocess.Popen(["bash", "-c", 'trap "" TSTP; exec sleep 60'], env=env)
    return subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)


def _ready(proc: subprocess.Popen[bytes], how: str) -> bool:
    try:
        with open(f"/proc/{proc.pid}/comm") as handle:
            execed = handle.read().strip() == "sleep"
        with open(f"/proc/{proc.pid}/status") as handle:
            ignored = [int(line.split()[1], 16) for line in handle if line.startswith("SigIgn:")]
    except OSError:
        return False
    return execed and (how != "ignored" or bool(ignored[0] & (1 << (signal.SIGTSTP - 1))))


@pytest.mark.parametrize("how", ["ignored", "orphaned"])
def test_a_lost_sigtstp_is_not_this_runs_freeze(how: str) -> None:
    tag = unique(f"trial3-lost-{how}")
    proc = _start(how, tag)
    try:
        assert wait_until(lambda: _ready(proc, how))
        with pytest.raises(ActivityError, match="none was seen stopped"):
            actions.signal_processes({"tag": tag}, "SIGTSTP", wait_stopped_s=0.5)
        assert proc_state(proc.pid) != "T"
        os.kill(proc.pid, signal.SIGSTOP)  # an operator stops it afterwards
        assert wait_until(lambda: proc_state(proc.pid) == "T")
        report = actions.resume_processes({"tag": tag})  # the rollback
        assert report["sent"] == 0, report
        assert [e["pid"] for e in report["left_stopped"]] == [proc.pid], report
        time.sleep(0.3)
        assert proc_state(proc.pid) == "T", "the rollback resumed someone else's stop"
    finally:
        proc.kill()
        proc.wait(5)
    assert not alive(proc.pid)


def test_the_report_names_a_lost_stop() -> None:
    tag = unique("trial3-lost-report")
    ignoring = _start("ignored", tag)
    try:
        assert wait_until(lambda: _ready(ignoring, "ignored"))
        report = actions.signal_processes({"tag": tag}, "SIGTSTP", wait_stopped_s=0.5,
                                          require_match=False)
        assert report["stopped"] == 0 and report["sent"] == 1, report
        assert [e["pid"] for e in report["stop_discarded"]] == [ignoring.pid], report
        assert "it ignores SIGTSTP" in report["stop_discarded"][0]["reason"], report
        assert report["results"][0]["stop_discarded"] is True, report
        assert actions.resume_processes({"tag": tag})["sent"] == 0
    finally:
        ignoring.kill()
        ignoring.wait(5)
    assert not alive(ignoring.pid)
