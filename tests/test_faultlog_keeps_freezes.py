"""The fault log keeps every fault of a large run: the rollbacks read it to undo what the run
froze, so a freeze of thousands of processes must not lose its first entries (before, the log
kept the last 1,000: resume_processes after freezing more left the oldest frozen)."""

from chaosgpu import faultlog


def test_a_freeze_of_five_thousand_processes_keeps_its_first_entry() -> None:
    faultlog.clear()
    try:
        for pid in range(100_000, 105_000):
            faultlog.record("SIGSTOP", pid=pid, starttime=7, scope="tag=big")
        assert [f["pid"] for f in faultlog.for_pid(100_000, 7)] == [100_000]
        assert len(faultlog.recent()) == 5_000
    finally:
        faultlog.clear()


def test_a_refreeze_after_a_clock_step_back_is_still_resumed(monkeypatch) -> None:
    """resume_processes undoes the freezes recorded after this run's last resume of a process,
    told by the log's order: with the wall clock stepped back an hour between a resume and a
    re-freeze (NTP, an operator), the re-freeze is still this run's and is resumed (before, the
    times were compared, the re-freeze looked older than the resume, and the process was left
    stopped). A real process, stopped and continued by signals; gone afterwards."""
    import os
    import subprocess
    import time
    import uuid

    from proc_helpers import finish, proc_state, wait_until

    from chaosgpu.process import actions

    tag = f"fl-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=tag),
                            stdin=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: proc_state(proc.pid) == "S", 10)
        actions.freeze_processes({"tag": tag})
        assert proc_state(proc.pid) == "T"
        actions.resume_processes({"tag": tag})
        assert wait_until(lambda: proc_state(proc.pid) == "S", 10)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 3600)
        actions.freeze_processes({"tag": tag})
        assert proc_state(proc.pid) == "T"
        resumed = actions.resume_processes({"tag": tag})
        assert resumed["left_stopped"] == [], resumed
        assert wait_until(lambda: proc_state(proc.pid) == "S", 10)
    finally:
        monkeypatch.undo()
        finish(proc)
