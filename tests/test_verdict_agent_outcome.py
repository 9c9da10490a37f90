"""A probe that comes after the job's ranks are gone judges the job by what the fault recorded
of its elastic agent, not by the faulted attempt alone (outside trial):

- a torchrun job whose rank chaosgpu killed restarts (restarts left) and its next attempt
  finishes: the agent exits 0, and a probe after that says `finished` (before: `failed`,
  from attempt 0's ranks, the only ones the fault saw);
- a standalone torchrun job with no restart left, its agent still tearing down (no rank, so
  the census names it `torchrun:PID`): every probe after the kill says `failed` under the
  job's id (before: the second probe said `unknown`, "no rank of this job has been seen",
  under the agent's id, and a wait for `failed` ran out its timeout).

Real processes: torchrun gloo jobs (tests/jobs/train.py); removed afterwards."""

from pathlib import Path

import pytest

pytest.importorskip("torch")

from jobs.launch import Job, start_torchrun  # noqa: E402

from chaosgpu.job import actions, probes  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_probe_after_the_agent_exited_0_says_finished(tmp_path: Path,
                                                        jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, ["--steps", "40"], max_restarts=1)
    jobs.append(job)
    job.wait_steps(3)
    killed = actions.kill_rank(tag=job.tag, rank=1, signal="SIGKILL", wait_s=0)
    assert killed["result"] == "sent", killed
    agent = job.processes[0].wait(timeout=180)
    state = probes.job_state(tag=job.tag, missing_ok=True)
    if agent == 0:
        assert state["verdict"] == "finished", state["reason"]
        assert "the elastic agent then exited 0" in state["reason"], state["reason"]
    else:  # the restarted attempt failed (its rendezvous, say): the agent's exit tells it
        assert state["verdict"] == "failed", state["reason"]
        assert "the elastic agent then ended" in state["reason"], state["reason"]


def test_every_probe_after_a_kill_names_the_job_while_its_agent_tears_down(
        tmp_path: Path, jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, [], max_restarts=0, standalone=True)
    jobs.append(job)
    job.wait_steps(3)
    killed = actions.kill_rank(tag=job.tag, rank=0, signal="SIGKILL", wait_s=0)
    assert killed["result"] == "sent", killed
    seen = []
    for _ in range(3):
        state = probes.job_state(tag=job.tag, missing_ok=True)
        seen.append((state.get("id"), state["verdict"], state["reason"]))
    assert all(verdict == "failed" for _, verdict, _ in seen), seen
    assert len({job_id for job_id, _, _ in seen}) == 1 and seen[0][0] == killed["job"], seen
