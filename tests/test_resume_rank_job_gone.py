"""The rollback resumes the rank this run froze even when the census no longer shows its job.
A torch.multiprocessing.spawn job found by its connections (no RANK, no MASTER_* in any
environment /proc shows) leaves the census once its other ranks end; before, `resume_rank`
then failed ("the job tagged ... is not running on this node") and the frozen rank stayed
stopped: the catalog's job-rank-freeze-recovery.json left it so (outside trial).

Real processes: the tutorial-shaped spawn job (tests/jobs/spawn_ddp.py); removed afterwards."""

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("torch")

from jobs.launch import Job, start_spawn, wait_spawn_steps  # noqa: E402
from proc_helpers import proc_state, wait_until  # noqa: E402

from chaosgpu.job import actions, hang  # noqa: E402
from chaosgpu.job.observe import select_jobs  # noqa: E402

pytestmark = pytest.mark.slow


def test_resume_rank_finds_the_frozen_rank_when_its_job_left_the_census(
        tmp_path: Path, jobs: list[Job]) -> None:
    job = start_spawn(tmp_path, world_size=2, loader_workers=0, rendezvous="rank-env")
    jobs.append(job)
    wait_spawn_steps(job, 3)
    [found] = select_jobs(hang._census(), tag=job.tag)
    frozen = actions.freeze_rank(rank="any", tag=job.tag)
    assert frozen["result"] == "sent" and proc_state(frozen["pid"]) == "T", frozen
    others = [r["pid"] for r in found["ranks"] if r["pid"] not in (None, frozen["pid"])]
    assert others, found["ranks"]
    for pid in others:  # its peer ends (as a process-group timeout would end it)
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not select_jobs(hang._census(), tag=job.tag), 30), \
        "the job is still in the census: nothing shown here"
    assert proc_state(frozen["pid"]) == "T"
    resumed = actions.resume_rank(rank="any", tag=job.tag)
    assert resumed["result"] == "sent" and resumed["pid"] == frozen["pid"], resumed
    assert wait_until(lambda: _not_stopped(frozen["pid"]), 10)
    again = actions.resume_rank(rank="any", tag=job.tag)  # a second rollback sends nothing
    assert again["result"] in ("already resumed by this run",  # its pending end may come
                               "ended since it was frozen: nothing left to resume"), again


def _not_stopped(pid: int) -> bool:
    try:
        return proc_state(pid) != "T"
    except FileNotFoundError:
        return True
