"""resume_rank undoes this run's freeze once: after the method resumed the rank, the rollback's
resume_rank (the catalog's "resume whatever happened") sends nothing, so a rank an operator
stopped in between (a debugger attached, a scheduler's suspend) stays stopped, as the docs
promise ("never one stopped by someone else"). Before, the second resume_rank sent SIGCONT
again and let that rank run; resume_processes after resume_rank did the same.

Real processes: a bare two-rank gloo job (tests/jobs/train.py), removed afterwards."""

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from jobs.launch import Job, start_bare  # noqa: E402
from proc_helpers import proc_state, wait_until  # noqa: E402

from chaosgpu.job import actions  # noqa: E402
from chaosgpu.process import actions as process_actions  # noqa: E402

pytestmark = pytest.mark.slow


def _stays_stopped(pid: int, seconds: float = 0.5) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc_state(pid) != "T":
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("rank", [1, "any"])
def test_a_second_resume_rank_leaves_a_rank_an_operator_stopped_since(
        tmp_path: Path, jobs: list[Job], rank: object) -> None:
    job = start_bare(tmp_path, [])
    jobs.append(job)
    job.wait_steps(3)
    frozen = actions.freeze_rank(rank=rank, tag=job.tag)
    pid = frozen["pid"]
    assert frozen["result"] == "sent" and proc_state(pid) == "T", frozen
    resumed = actions.resume_rank(rank=rank, tag=job.tag)  # the method's resume
    assert resumed["result"] == "sent" and resumed["pid"] == pid, resumed
    assert wait_until(lambda: proc_state(pid) != "T")
    os.kill(pid, signal.SIGSTOP)  # an operator stops it (a debugger, say)
    try:
        assert wait_until(lambda: proc_state(pid) == "T")
        again = actions.resume_rank(rank=rank, tag=job.tag)  # the rollback's resume
        assert again["result"] == "already resumed by this run" and again["pid"] == pid, again
        assert _stays_stopped(pid), "the rollback resumed a rank stopped by someone else"
        left = process_actions.resume_processes({"tag": job.tag})
        assert [e["pid"] for e in left["left_stopped"]] == [pid], left
        assert _stays_stopped(pid), "resume_processes resumed a rank stopped by someone else"
    finally:
        os.kill(pid, signal.SIGCONT)
    # a new freeze by this run is this run's to undo again
    refrozen = actions.freeze_rank(rank=rank, tag=job.tag)
    assert refrozen["pid"] == pid and proc_state(pid) == "T", refrozen
    assert actions.resume_rank(rank=rank, tag=job.tag)["result"] == "sent"
    assert wait_until(lambda: proc_state(pid) != "T")


def test_a_lost_sigtstp_of_kill_rank_is_no_freeze_of_this_run(tmp_path: Path,
                                                              jobs: list[Job]) -> None:
    """kill_rank's SIGTSTP to a rank in a session of its own (an orphaned process group: the
    kernel discards the signal) never stops it: the action fails saying so and records no
    freeze, so the rollback's resume_rank leaves a later stop by an operator as found. Before,
    the lost SIGTSTP was recorded and resume_rank sent SIGCONT to the operator's stop."""
    job = start_bare(tmp_path, [])
    jobs.append(job)
    job.wait_steps(3)
    with pytest.raises(Exception, match="will never stop it"):
        actions.kill_rank(rank=1, tag=job.tag, signal="SIGTSTP")
    from chaosgpu.job import probes

    pid = next(r["pid"] for r in probes.job_ranks(tag=job.tag) if r["rank"] == 1)
    assert proc_state(pid) != "T"
    os.kill(pid, signal.SIGSTOP)  # an operator stops it afterwards
    try:
        assert wait_until(lambda: proc_state(pid) == "T")
        resumed = actions.resume_rank(rank=1, tag=job.tag)
        assert resumed.get("result") != "sent", resumed
        assert _stays_stopped(pid), "the rollback resumed a rank stopped by someone else"
    finally:
        os.kill(pid, signal.SIGCONT)
