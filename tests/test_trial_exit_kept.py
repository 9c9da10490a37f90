"""How a rank ended, once seen, stays seen by the probes that follow: a fault's pooled pidfds
on the job's ranks (watch_peers) must outlive the first observer that reads them. Before, the
first probe after a kill closed them as it recorded each exit, so the next probe of the same
run read "exit status not visible (not watched before it ended)" for the very rank the first
one had seen killed by torchrun's SIGTERM: the evidence changed from one probe to the next and,
for a job whose faulted rank exited 0 (a SIGTERM handler), the verdict went from "failed" to
"unknown" (seen on a torchrun job whose ranks stop cleanly on SIGTERM).

Real processes: a torchrun gloo job (tests/jobs/train.py), removed afterwards."""

from pathlib import Path

import pytest

pytest.importorskip("torch")

from jobs.launch import Job, start_torchrun  # noqa: E402

from chaosgpu.job import actions, probes  # noqa: E402

pytestmark = pytest.mark.slow


def _exits(state: dict) -> dict:
    return {r["rank"]: (r["exit"] or {}).get("text") for r in state["ranks"]}


def test_a_later_probe_still_reads_how_each_rank_ended(tmp_path: Path, jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, [])
    jobs.append(job)
    job.wait_steps(3)
    killed = actions.kill_rank(rank=1, job=job.run_id, signal="SIGKILL", wait_s=5)
    assert killed["result"] == "sent", killed
    first = probes.wait_job_verdict(["failed"], job=job.run_id, timeout_s=20, missing_ok=True)
    assert first["verdict"] == "failed", first["reason"]
    seen = _exits(first)
    if any(text is None or "not visible" in text for text in seen.values()):
        pytest.skip(f"this kernel does not report exits through pidfds (Linux < 6.15): {seen}")
    job.wait_exit(20)
    for _ in range(2):  # the next probes of the same run, the job gone by now
        later = probes.job_state(job=job.run_id, missing_ok=True)
        assert later["verdict"] == "failed", later["reason"]
        assert _exits(later) == seen, (later["reason"], seen)
        assert [c["rank"] for c in later["culprit_ranks"]] == \
            [c["rank"] for c in first["culprit_ranks"]], later["culprit_ranks"]
