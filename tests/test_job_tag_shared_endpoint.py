"""A job selected by tag is what of it carries the tag. Two jobs whose ranks share one
MASTER_ADDR:MASTER_PORT (the ranks of an earlier job left on torchrun's default port, say)
are one job id in the census; before, `freeze_rank(rank="any", tag=A)` stopped a rank of the
job tagged B, and `cleanup_hung_job(tag=A)` SIGTERMed B's ranks too (found by an outside
trial). Now neither touches a process that carries another tag.

Real processes (sleeps with a rank's environment), in sessions of their own; each is proven
gone afterwards."""

import os
import subprocess
import uuid

from proc_helpers import finish, proc_state, wait_until

from chaosgpu.job import actions, hang
from chaosgpu.job.observe import select_jobs


def _ranks(tag: str, port: int) -> list["subprocess.Popen[bytes]"]:
    return [subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, start_new_session=True,
                             env=dict(os.environ, CHAOSGPU_TAG=tag, RANK=str(rank),
                                      WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port)))
            for rank in (0, 1)]


def test_a_tag_never_reaches_the_ranks_of_another_job_on_the_same_endpoint() -> None:
    mine, theirs = f"ta-{uuid.uuid4().hex[:8]}", f"tb-{uuid.uuid4().hex[:8]}"
    port = 20000 + int(uuid.uuid4().hex[:4], 16) % 20000
    first, second = _ranks(mine, port), _ranks(theirs, port)
    procs = first + second
    try:
        assert wait_until(lambda: all(proc_state(p.pid) == "S" for p in procs), 10)
        census = hang._census()
        [whole] = select_jobs(census, job=f"127.0.0.1:{port}")
        assert sorted(r["pid"] for r in whole["ranks"]) == sorted(p.pid for p in procs)
        [part] = select_jobs(census, tag=theirs)  # the tag the census did not name the job by
        assert sorted(r["pid"] for r in part["ranks"]) == sorted(p.pid for p in second)
        assert part["survivors"] == [0, 1] and part["other_tags"] == [mine], part

        frozen = actions.freeze_rank(rank="any", tag=mine)
        assert frozen["pid"] in {p.pid for p in first}, frozen
        assert [proc_state(p.pid) for p in second] == ["S", "S"]
        actions.resume_rank(rank="any", tag=mine)
        assert wait_until(lambda: all(proc_state(p.pid) == "S" for p in first), 10)

        killed = actions.kill_rank(rank=1, tag=theirs, signal="SIGTERM", wait_s=5)
        assert killed["pid"] == second[1].pid, killed
        assert second[1].wait(timeout=10) == -15

        report = actions.cleanup_hung_job(tag=mine, grace_s=2, deadline_s=10)
        assert sorted(report["removed"]) == sorted(p.pid for p in first), report
        for proc in first:  # reaped by the cleanup (this test is their parent)
            proc.wait(timeout=10)
            assert not os.path.exists(f"/proc/{proc.pid}"), proc.pid
        assert proc_state(second[0].pid) == "S"  # the other job's rank lives on
    finally:
        finish(*procs)


def test_an_untagged_rank_on_the_same_endpoint_is_in_no_tags_part() -> None:
    """A process with a rank's environment but no tag, on the endpoint of a tagged job (a rank
    of another job, started without chaosgpu's tag): selected by tag it is never in the job,
    so freeze_rank(rank="any") and cleanup_hung_job never reach it (before: it was frozen and
    SIGTERMed with the tagged ranks; outside trial)."""
    mine = f"ta-{uuid.uuid4().hex[:8]}"
    port = 20000 + int(uuid.uuid4().hex[:4], 16) % 20000
    tagged = _ranks(mine, port)
    env = {k: v for k, v in os.environ.items() if k != "CHAOSGPU_TAG"}
    stray = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, start_new_session=True,
                             env=dict(env, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port)))
    procs = [*tagged, stray]
    try:
        assert wait_until(lambda: all(proc_state(p.pid) == "S" for p in procs), 10)
        [part] = select_jobs(hang._census(), tag=mine)
        assert sorted(r["pid"] for r in part["ranks"]) == sorted(p.pid for p in tagged), part
        assert part["other_tags"] == ["(none)"], part
        for _ in range(2):  # "any" picks the last live rank: never the stray one
            frozen = actions.freeze_rank(rank="any", tag=mine)
            assert frozen["pid"] != stray.pid, frozen
            actions.resume_rank(rank="any", tag=mine)
        report = actions.cleanup_hung_job(tag=mine, grace_s=2, deadline_s=10)
        assert stray.pid not in report["removed"], report
        assert proc_state(stray.pid) == "S"
    finally:
        finish(*procs)
