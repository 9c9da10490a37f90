"""An elastic agent that cannot act restarts nothing, and a rank that exits 0 on chaosgpu's own
SIGTERM is named with that SIGTERM.

`restarting` ("the elastic agent lives and a new attempt is on its way") was claimed whenever
the torchrun agent process was alive, even when it was stopped (SIGSTOP, state T) and so could
neither tear down nor restart anything: `torchrun --max-restarts 2`, `kill -STOP` the agent,
`kill -9` a rank, and `chaosgpu jobs --observe 8` said RESTARTING for all 8 s. Now a stopped or
frozen agent is a culprit: with no live rank the verdict is `unknown` until that has held for
the window, then `hung` with the agent as culprit; with live ranks the verdict is what they
show, the agent among the culprits of a hang; once the agent resumes it is `restarting` again.

A rank that exited 0 after chaosgpu's SIGTERM (a job with a SIGTERM handler that exits cleanly)
was never chaosgpu's fault: the failure story said "rank 0 exit 1; rank 1 exit 0, seen ended
together with rank 0", rank 0 alone the culprit, the SIGTERM never mentioned.

Real processes: torchrun gloo jobs (tests/jobs/train.py), real signals; every process is removed
afterwards (a stopped agent is resumed and killed in a `finally`) and proven gone."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from jobs.launch import TRAIN, Job, _env, free_port, start_torchrun  # noqa: E402
from proc_helpers import alive, proc_state, tagged, wait_until  # noqa: E402

from chaosgpu.job import actions, probes  # noqa: E402
from chaosgpu.job.observe import Observer  # noqa: E402

pytestmark = pytest.mark.slow


def _stop(pid: int) -> float:
    """SIGSTOP `pid` and wait until /proc shows it stopped; return when the signal was sent."""
    sent = time.time()
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: proc_state(pid) == "T", 5.0), proc_state(pid)
    return sent


def _remove(job: Job, agent: int | None = None) -> None:
    """Resume the stopped `agent` first, then resume and kill every process of the job and
    prove them gone: the launcher reaped, nothing carrying the job's tag left (zombies of a
    stopped agent included)."""
    if agent is not None:
        with contextlib.suppress(OSError):
            os.kill(agent, signal.SIGCONT)
    job.stop()  # SIGCONT + SIGKILL to its process group and to everything carrying its tag
    assert all(proc.poll() is not None for proc in job.processes), job.processes
    assert wait_until(lambda: not tagged(job.tag), 10.0), tagged(job.tag)


def _agent_culprits(found: dict[str, Any], agent: int) -> list[dict[str, Any]]:
    return [c for c in found["culprit_ranks"] if c.get("role") == "launcher"
            and c["pid"] == agent and c["rank"] is None]


def _tick_until(observer: Observer, job: Job, seconds: float, stop: Any
                ) -> tuple[list[tuple[float, str, str]], Any]:
    """Tick for up to `seconds` until `stop(track)`; every (time, verdict, reason) seen."""
    seen: list[tuple[float, str, str]] = []
    track = None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        observer.tick()
        track = observer.tracks.get(job.run_id)
        if track is not None:
            seen.append((time.time(), track.verdict, track.reason))
            if stop(track):
                break
        observer.pause(observer.tick_s)
    return seen, track


def test_a_stopped_agent_with_every_rank_ended_is_never_restarting_then_hung(
        tmp_path: Path, jobs: list[Job]) -> None:
    """The outside trial's reproduction: agent stopped, a rank killed (the survivor fails on
    the closed connection): never `restarting` while the agent is stopped; `hung` once that
    has held for the window, the agent the culprit; after SIGCONT, `restarting` again."""
    job = start_torchrun(tmp_path, [], max_restarts=2)
    jobs.append(job)
    agent = job.processes[0].pid
    observer = Observer(job=job.run_id, window_s=3.0)
    try:
        job.wait_steps(3)
        seen, track = _tick_until(observer, job, 20.0, lambda t: t.verdict == "running")
        assert track is not None and track.verdict == "running", seen
        stopped_at = _stop(agent)
        os.kill(job.progress()[1]["pid"], signal.SIGKILL)
        seen, track = _tick_until(observer, job, 30.0, lambda t: t.verdict == "hung")
        assert proc_state(agent) == "T"  # ground truth: stopped all along
        verdicts = [v for _, v, _ in seen]
        assert "restarting" not in verdicts, seen
        assert track is not None and track.verdict == "hung", (seen, track.history)
        found = track.to_json()
        assert not any(r["state"] in ("alive", "stopped", "frozen") for r in found["ranks"])
        (culprit,) = _agent_culprits(found, agent)
        assert "stopped" in culprit["why"] and "neither tear down nor restart" in culprit["why"]
        assert "no attempt can start until it resumes" in found["reason"], found["reason"]
        assert found["blocked"] == [] and found["blocked_in"]["ranks"] == []
        # the window is a correctness window: not before it, from the stop and the last end
        ended = max(r["exited_at"] for r in found["ranks"])
        assert found["since"] >= stopped_at and found["since"] >= ended - 0.01, found
        assert found["confirmed_at"] - found["since"] >= 3.0 - 0.01, found
        assert found["launcher"]["state"] == "stopped", found["launcher"]
        assert any(e["what"].startswith("launcher stopped") for e in found["evidence"])
        assert (job.progress()[0].get("restart") or "0") == "0"  # no new attempt started

        os.kill(agent, signal.SIGCONT)
        seen, track = _tick_until(observer, job, 60.0, lambda t: t.verdict == "failed" or (
            t.verdict in ("running", "hung") and (t.restart_count() or 0) >= 1))
        verdicts = [v for _, v, _ in seen]
        assert verdicts[0] == "restarting", seen  # what the agent does now is observed again
        assert track is not None
        assert any(e["what"].startswith("launcher resumed") for e in track.evidence)
        after = track.to_json()
        assert after["launcher"]["state"] in ("alive", "exited"), after["launcher"]
        assert not _agent_culprits(after, agent), after["culprit_ranks"]
        # torch's restart then runs, sticks in its rendezvous or fails (the agent exits once
        # its restarts are spent): each is said with its evidence
        assert track.verdict in ("running", "hung", "failed"), (seen, track.history)
    finally:
        observer.close()
        _remove(job, agent)


def test_a_stopped_agent_whose_ranks_ended_is_hung_for_the_probes_and_cleaned_up(
        tmp_path: Path, jobs: list[Job]) -> None:
    """The same hang through the probes: detect_hang returns `hung` with no live rank and the
    agent the culprit, and cleanup_hung_job removes the stopped agent and its unreaped ranks."""
    job = start_torchrun(tmp_path, [], max_restarts=2)
    jobs.append(job)
    agent = job.processes[0].pid
    try:
        job.wait_steps(3)
        _stop(agent)
        os.kill(job.progress()[1]["pid"], signal.SIGKILL)
        found = probes.detect_hang(job=job.run_id, timeout_s=30)
        assert found["verdict"] == "hung" and found["hung"] is True, found["reason"]
        assert _agent_culprits(found, agent), found["culprit_ranks"]
        assert all(r["state"] == "exited" for r in found["ranks"]), found["ranks"]
        report = actions.cleanup_hung_job(job=job.run_id, grace_s=1, deadline_s=30)
        assert report["not_removed"] == [], report
        assert agent in report["removed"], report
        assert wait_until(lambda: job.processes[0].poll() is not None, 10.0)
        assert not tagged(job.tag, live_only=True), tagged(job.tag)
    finally:
        _remove(job, agent)


def test_a_stopped_agent_with_live_survivors_is_among_the_culprits(
        tmp_path: Path, jobs: list[Job]) -> None:
    """Agent stopped, rank 1 frozen by chaosgpu: rank 0 waits in its all_reduce. The verdict is
    what the ranks show (hung), never `restarting`, and the agent is among the culprits."""
    job = start_torchrun(tmp_path, [], max_restarts=2)
    jobs.append(job)
    agent = job.processes[0].pid
    try:
        job.wait_steps(3)
        _stop(agent)
        frozen = actions.freeze_rank(job=job.run_id, rank=1)
        assert frozen["result"] == "sent", frozen
        found = probes.detect_hang(job=job.run_id, timeout_s=30)
        assert found["verdict"] == "hung", found["reason"]
        assert found["blocked_in"]["ranks"] == [0], found["blocked_in"]
        culprits = {c["rank"]: c for c in found["culprit_ranks"] if c.get("role") != "launcher"}
        assert culprits[1]["why"].startswith("stopped"), culprits
        (culprit,) = _agent_culprits(found, agent)
        assert "stopped" in culprit["why"], culprit
        assert "the elastic agent" in found["reason"], found["reason"]
        assert "restarting" not in [h["verdict"] for h in found["history"]], found["history"]
        assert proc_state(agent) == "T" and alive(job.progress()[0]["pid"])
        report = actions.cleanup_hung_job(job=job.run_id, grace_s=1, deadline_s=30)
        assert report["not_removed"] == [], report
        assert agent in report["removed"], report
    finally:
        _remove(job, agent)


#: tests/jobs/train.py run by a rank that stops cleanly on SIGTERM (exit 0), as trainers with a
#: preemption handler do; written next to the job, so the job script itself stays as it is
_SIGTERM_EXITS_0 = '''
import os, runpy, signal, sys

def _stop(signum, frame):
    print(f"rank {os.environ.get('RANK')}: SIGTERM, stopping cleanly", file=sys.stderr,
          flush=True)
    os._exit(0)

signal.signal(signal.SIGTERM, _stop)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _start_torchrun_exit0_on_sigterm(workdir: Path) -> Job:
    """torchrun --nproc-per-node 2 (no restart) of train.py whose ranks exit 0 on SIGTERM."""
    wrapper = workdir / "sigterm_exits_0.py"
    wrapper.write_text(_SIGTERM_EXITS_0)
    tag = f"verdict-{uuid.uuid4().hex[:8]}"
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    job = Job(run_id, tag, workdir, world_size=2)
    job.progress_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--max-restarts=0", "--monitor-interval=0.1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}",
            str(wrapper), str(TRAIN), "--progress-dir", str(job.progress_dir)]
    with open(workdir / "torchrun.log", "wb") as log:
        job.processes.append(subprocess.Popen(argv, env=_env(tag), stdout=log, stderr=log,
                                              stdin=subprocess.DEVNULL,
                                              start_new_session=True))
    return job


def test_a_rank_that_exits_0_on_chaosgpus_sigterm_is_named_with_it(
        tmp_path: Path, jobs: list[Job]) -> None:
    """chaosgpu SIGTERMs rank 1, which exits 0; rank 0 then fails on the closed connection.
    The story says rank 1 exited 0 after chaosgpu's SIGTERM, and rank 1 is a culprit."""
    job = _start_torchrun_exit0_on_sigterm(tmp_path)
    jobs.append(job)
    try:
        job.wait_steps(3)
        sent = actions.kill_rank(rank=1, job=job.run_id, signal="SIGTERM", wait_s=5)
        assert sent["result"] == "sent", sent
        found = probes.wait_job_verdict(["failed"], job=job.run_id, timeout_s=30,
                                        missing_ok=True)
        assert found["verdict"] == "failed", (found["reason"], job.logs())
        ranks = {r["rank"]: r for r in found["ranks"]}
        if any("does not report the exit status" in ((r["exit"] or {}).get("note") or "")
               for r in ranks.values()):
            pytest.skip(f"this kernel does not report exits through pidfds: {found['reason']}")
        assert ranks[1]["exit"]["code"] == 0, ranks[1]  # ground truth: its handler's exit 0
        log = (tmp_path / "torchrun.log").read_text(errors="replace")
        assert "rank 1: SIGTERM, stopping cleanly" in log, job.logs()
        assert "rank 1 exit 0 after chaosgpu's SIGTERM" in found["reason"], found["reason"]
        culprits = {c["rank"]: c["why"] for c in found["culprit_ranks"]}
        assert "chaosgpu's SIGTERM" in culprits.get(1, ""), found["culprit_ranks"]
        job.wait_exit(30)
        later = probes.job_state(job=job.run_id, missing_ok=True)  # a later probe says the same
        assert later["verdict"] == "failed", later["reason"]
        assert "rank 1 exit 0 after chaosgpu's SIGTERM" in later["reason"], later["reason"]
    finally:
        _remove(job)
