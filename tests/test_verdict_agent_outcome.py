"""A probe that comes after the job's ranks are gone judges the job by what the fault recorded
of its elastic agent, not by the faulted attempt alone (outside trial):

- a torchrun job whose rank chaosgpu killed restarts (restarts left) and its next attempt
  finishes: the agent exits 0, and a probe after that says `finished` (before: `failed`,
  from attempt 0's ranks, the only ones the fault saw); where the next attempt fails instead,
  `failed` names the agent's exit and no culprit from attempt 0 (its ranks did not end the
  job);
- a standalone torchrun job with no restart left, its agent still tearing down (no rank, so
  the census names it `torchrun:PID`): every probe after the kill says `failed` under the
  job's id (before: the second probe said `unknown`, "no rank of this job has been seen",
  under the agent's id, and a wait for `failed` ran out its timeout).

Real processes: torchrun gloo jobs (tests/jobs/train.py); removed afterwards."""

import os
import signal
import subprocess
from pathlib import Path

import pytest
from proc_helpers import tagged

pytest.importorskip("torch")

from jobs.launch import Job, start_torchrun  # noqa: E402

from chaosgpu.job import actions, probes  # noqa: E402

pytestmark = pytest.mark.slow


def _wait_for_the_agent(job: Job) -> "subprocess.Popen[bytes]":
    """Wait for torchrun to exit. A restarted attempt that torch leaves stuck (in its
    rendezvous or gloo's connect, as seen here under load) is ended as a failure would end
    it, with no restart left, so that the agent exits non-zero."""
    agent = job.processes[0]
    try:
        agent.wait(timeout=120)
    except subprocess.TimeoutExpired:
        for pid in tagged(job.tag, live_only=True):
            if pid != agent.pid:
                os.kill(pid, signal.SIGKILL)
        agent.wait(timeout=120)
    return agent


def test_a_probe_after_the_agent_exited_0_says_finished(tmp_path: Path,
                                                        jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, ["--steps", "40"], max_restarts=1)
    jobs.append(job)
    job.wait_steps(3)
    killed = actions.kill_rank(tag=job.tag, rank=1, signal="SIGKILL", wait_s=0)
    assert killed["result"] == "sent", killed
    agent = _wait_for_the_agent(job)
    state = probes.job_state(tag=job.tag, missing_ok=True)
    if agent.returncode == 0:
        assert state["verdict"] == "finished", state["reason"]
        assert "the elastic agent then exited 0" in state["reason"], state["reason"]
    else:  # the restarted attempt failed (its rendezvous, say): the agent's exit tells it
        assert state["verdict"] == "failed", state["reason"]
        # restarts were left after the attempt the fault saw: the attempt that ended the job
        # was not seen, and neither were its ranks (no culprit named from attempt 0)
        assert "the elastic agent ended" in state["reason"], state["reason"]
        assert state["culprit_ranks"] == [], state["culprit_ranks"]


def test_every_probe_after_a_kill_names_the_job_while_its_agent_tears_down(
        tmp_path: Path, jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, [], max_restarts=0, standalone=True)
    jobs.append(job)
    job.wait_steps(3)
    killed = actions.kill_rank(tag=job.tag, rank=0, signal="SIGKILL", wait_s=0)
    assert killed["result"] == "sent", killed
    # the survivor may still read as running for a moment (its last step was just now)
    first = probes.wait_job_verdict(["failed"], tag=job.tag, timeout_s=60, missing_ok=True)
    seen = [(first.get("id"), first["verdict"], first["reason"])]
    for _ in range(2):  # the probes that follow, while the agent tears down or is gone
        state = probes.job_state(tag=job.tag, missing_ok=True)
        seen.append((state.get("id"), state["verdict"], state["reason"]))
    assert all(verdict == "failed" for _, verdict, _ in seen), seen
    assert len({job_id for job_id, _, _ in seen}) == 1 and seen[0][0] == killed["job"], seen


def test_a_later_attempt_that_fails_is_no_culprit_of_the_attempt_seen(
        tmp_path: Path, jobs: list[Job]) -> None:
    """The restarted attempt fails by itself (rank 0 raises at step 8, restarts used up): a
    probe after the agent exited says `failed`, from the agent's exit, and names no culprit
    of the attempt the fault saw (before: "rank 1 killed by SIGKILL (chaosgpu's fault)" was
    the culprit and "restarts left" was claimed; outside trial)."""
    job = start_torchrun(tmp_path, ["--fail-rank", "0", "--fail-at", "8"], max_restarts=1)
    jobs.append(job)
    job.wait_steps(3)
    killed = actions.kill_rank(tag=job.tag, rank=1, signal="SIGKILL", wait_s=0)
    assert killed["result"] == "sent", killed
    _wait_for_the_agent(job)
    assert job.processes[0].returncode != 0, job.logs()
    state = probes.job_state(tag=job.tag, missing_ok=True)
    assert state["verdict"] == "failed", state["reason"]
    assert "the elastic agent ended" in state["reason"], state["reason"]
    assert state["culprit_ranks"] == [], state["culprit_ranks"]
