"""Job faults and probes on the project's own gloo ring (chaosgpu.workloads.ring): freeze,
resume, kill and fail a rank, the observed verdicts they lead to, hang cleanup that leaves
nothing alive and is idempotent; bad and vacuous input."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_tool

pytest.importorskip("torch")

from chaosgpu import progress  # noqa: E402
from chaosgpu.errors import ActivityError, InvalidArgument  # noqa: E402
from chaosgpu.job import actions, probes  # noqa: E402
from chaosgpu.job.observe import JobError  # noqa: E402
from chaosgpu.workloads.ring import RingConfig, RingLaunch, launch_ring  # noqa: E402


def _stop(launch: RingLaunch) -> None:
    from chaosgpu.process import freezer

    freezer.thaw({proc.pid for proc in launch.processes})  # a test that failed mid-freeze
    for proc in launch.processes:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, 18)  # SIGCONT, then kill
            except OSError:
                pass
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[tuple[str, RingLaunch]]:
    tag = f"job-test-{uuid.uuid4().hex[:8]}"
    launch = launch_ring(RingConfig(backend="gloo", world_size=3, ready_dir=str(tmp_path),
                                    tag=tag, timeout_s=60, log_dir=str(tmp_path / "logs")),
                         detach=True)
    try:
        launch.wait_ready(90)
        yield tag, launch
    finally:
        _stop(launch)


def test_frozen_rank_hangs_the_ring_and_is_cleaned_up(ring: tuple[str, RingLaunch]) -> None:
    tag, launch = ring
    assert probes.job_hung(tag=tag) is False
    assert [r["state"] for r in probes.job_ranks(tag=tag)] == ["alive"] * 3
    frozen = actions.freeze_rank(tag=tag, rank=1)
    assert frozen["result"] == "sent" and frozen["method"] == "sigstop"
    found = probes.detect_hang(tag=tag, timeout_s=20)
    assert found["hung"] is True, found["reason"]
    assert sorted(found["blocked_in"]["ranks"]) == [0, 2]
    assert found["blocked_in"]["kind"] in ("wait", "collective"), found["blocked_in"]
    assert [c["rank"] for c in found["culprit_ranks"]] == [1]
    assert found["detection"]["after_fault_s"] < 5.0
    assert all(b["stack"] and "ring.py" in b["stack"] for b in found["blocked"])
    assert probes.job_hung(tag=tag) is True
    started = time.monotonic()
    report = actions.cleanup_hung_job(tag=tag, grace_s=2, deadline_s=20)
    assert time.monotonic() - started < 5.0
    assert report["not_removed"] == [], report
    assert sorted(report["removed"]) == sorted(launch.pids)
    again = actions.cleanup_hung_job(tag=tag)
    assert again["found"] == 0 and "nothing to clean up" in again["note"]


def test_resume_rank_by_number_leaves_a_rank_stopped_by_someone_else(
        ring: tuple[str, RingLaunch]) -> None:
    """A rollback resume_rank(rank=1) in a run that froze nothing (an operator stopped rank 1,
    the run failed its steady state before the method): nothing is sent and rank 1 stays
    stopped (before round 22 it was SIGCONTed)."""
    tag, _ = ring
    pid = next(r["pid"] for r in probes.job_state(tag=tag)["ranks"] if r["rank"] == 1)
    os.kill(pid, signal.SIGSTOP)  # stopped by someone else (a debugger, say)
    try:
        left = actions.resume_rank(tag=tag, rank=1)
        assert left["result"] == "not frozen by this run" and left["pid"] == pid, left
        time.sleep(0.3)
        with open(f"/proc/{pid}/stat", "rb") as handle:
            assert handle.read().rsplit(b")", 1)[1].split()[0] == b"T"
        frozen = actions.freeze_rank(tag=tag, rank=2)
        assert actions.resume_rank(tag=tag, rank=2)["result"] == "sent", frozen
    finally:
        os.kill(pid, signal.SIGCONT)


def test_freeze_then_resume_runs_again_and_a_killed_rank_fails_the_ring(
        ring: tuple[str, RingLaunch]) -> None:
    tag, launch = ring
    actions.freeze_rank(tag=tag, rank=2)
    assert actions.resume_rank(tag=tag, rank=2)["result"] == "sent"
    assert probes.job_state(tag=tag)["verdict"] == "running"
    killed = actions.kill_rank(tag=tag, rank=0, signal="SIGKILL", wait_s=5)
    assert killed["result"] == "sent" and killed["wait"]["all_gone"]
    found = probes.detect_hang(tag=tag, timeout_s=20)
    assert found["verdict"] == "failed" and found["hung"] is False, found["reason"]
    report = actions.cleanup_hung_job(tag=tag, grace_s=2, deadline_s=20)
    assert report["not_removed"] == [], report


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/sys/fs/cgroup/freezer/cgroup.procs"),
                    reason="needs root and the cgroup v1 freezer")
def test_rank_frozen_by_the_freezer_is_a_frozen_culprit(ring: tuple[str, RingLaunch]) -> None:
    tag, launch = ring
    frozen = actions.freeze_rank(tag=tag, rank=1, method="freezer")
    assert frozen["freezer_state"] == "FROZEN" and frozen["frozen"] == [frozen["pid"]]
    found = probes.detect_hang(tag=tag, timeout_s=20)
    assert found["hung"] is True, found["reason"]
    (culprit,) = found["culprit_ranks"]
    assert culprit["rank"] == 1 and culprit["why"].startswith("frozen"), culprit
    # A frozen process ignores SIGKILL until thawed: the cleanup must thaw first.
    report = actions.cleanup_hung_job(tag=tag, grace_s=1, deadline_s=20)
    assert report["not_removed"] == [], report
    assert report["steps"][0]["thawed_cgroups"], report
    assert sorted(report["removed"]) == sorted(launch.pids)


def test_survivors_end_by_themselves_with_a_short_group_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="chaostoolkit")
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.5)  # the wait's progress, seen below
    tag = f"job-test-{uuid.uuid4().hex[:8]}"
    launch = launch_ring(RingConfig(backend="gloo", world_size=3, ready_dir=str(tmp_path),
                                    tag=tag, timeout_s=3, log_dir=str(tmp_path / "logs")),
                         detach=True)
    try:
        launch.wait_ready(90)
        job_id = actions.fail_rank(tag=tag, rank=0, how="freeze")["job"]
        from chaosgpu.scope import resolve_scope

        assert len(resolve_scope({"job": job_id})) == 3
        short = probes.wait_survivors_exit(tag=tag, timeout_s=0.5)
        assert short["all_exited"] is False and short["survivors"] == [1, 2]
        caplog.clear()
        waited = probes.wait_survivors_exit(tag=tag, timeout_s=60)
        assert waited["all_exited"] is True, waited
        lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
        assert lines and all(line.startswith(
            f"chaosgpu: still waiting for the survivors of the job tagged {tag!r} to end by "
            "themselves: ") and
            "of at most 60 s; " in line for line in lines), lines
        assert set(waited["exits"]) == {"1", "2"}
        assert all(e["exit"]["code"] not in (None, 0) for e in waited["exits"].values())
        report = actions.cleanup_hung_job(tag=tag, grace_s=1, deadline_s=20)
        assert report["not_removed"] == [], report
        gone = probes.wait_survivors_exit(tag=tag, timeout_s=1, missing_ok=True)
        assert gone["all_exited"] is True
    finally:
        _stop(launch)


def test_bad_and_vacuous_job_input_is_refused_and_changes_nothing() -> None:
    nope = f"nope-{uuid.uuid4().hex}"
    with pytest.raises(TypeError):
        actions.kill_rank(tag="x")  # type: ignore[call-arg]
    with pytest.raises(JobError, match="name the job"):
        actions.kill_rank(rank=0)
    with pytest.raises(ValueError, match="rank must be a rank number"):
        actions.kill_rank(tag="x", rank=-1)
    with pytest.raises(ValueError, match="wait_s must be"):
        actions.kill_rank(tag="x", rank=0, wait_s=-1)
    with pytest.raises(ValueError, match="signal must be"):
        actions.kill_rank(tag="x", rank=0, signal="SIGNOPE")
    with pytest.raises(ValueError, match="signal must be"):  # the signal program's own set
        actions.kill_rank(tag="x", rank=0, signal="SIGSYS")
    with pytest.raises(JobError, match="not running"):
        actions.kill_rank(job=nope, rank=0)
    with pytest.raises(ValueError, match="how must be"):
        actions.fail_rank(tag="x", rank=0, how="explode")
    with pytest.raises(InvalidArgument, match="detect_hang: tag must be .*non-empty string"):
        probes.detect_hang(tag="")
    with pytest.raises(JobError, match="unsubstituted"):
        probes.job_hung(job="${job}")
    with pytest.raises(JobError, match="not running"):
        probes.job_hung(tag=nope)
    with pytest.raises(JobError, match="not running"):
        probes.detect_hang(tag=nope, timeout_s=0.2)
    assert probes.job_hung(tag=nope, missing_ok=True) is False
    assert probes.job_state(tag=nope, missing_ok=True)["found"] is False
    with pytest.raises(JobError, match="not running"):
        probes.job_ranks(tag=nope)
    assert probes.job_ranks(tag=nope, missing_ok=True) == []
    with pytest.raises(ValueError, match="window_s must be"):
        probes.job_state(tag="x", window_s=0)
    with pytest.raises(ValueError, match="verdicts must be"):
        probes.wait_job_verdict(["stuck"], tag="x")
    with pytest.raises(JobError, match=f"tag '{nope}' matches no process, and this run never "
                                       "met it .*: a typo"):
        actions.cleanup_hung_job(tag=nope)  # a typo'd rollback would leave the job running
    assert actions.cleanup_hung_job(tag=nope, missing_ok=True)["found"] == 0


#: A rank that prints the name of each signal it receives (SIGCONT, SIGTERM: handled, so it
#: lives on), after "ready" once its handlers are set.
SIGNAL_RECORDER = ("import signal, time\n"
                   "for s in (signal.SIGCONT, signal.SIGTERM):\n"
                   "    signal.signal(s, lambda n, f: print(signal.Signals(n).name, flush=True))\n"
                   "print('ready', flush=True)\n"
                   "time.sleep(60)\n")


def _rank_env(tag: str, rank: int) -> dict[str, str]:
    return dict(os.environ, CHAOSGPU_TAG=tag, RANK=str(rank), LOCAL_RANK=str(rank),
                WORLD_SIZE="2")


def _nobodys_rank(tag: str, rank: int) -> subprocess.Popen[str]:
    """A rank of the job tagged `tag` run by another user (nobody, UID 65534)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process of another user")
    require_tool("setpriv", install="apt-get install util-linux")
    proc = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                             sys.executable, "-c", SIGNAL_RECORDER], env=_rank_env(tag, rank),
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _signals_received(proc: subprocess.Popen[str]) -> str:
    """Kill the signal recorder; return what it printed after "ready"."""
    proc.kill()
    out, _ = proc.communicate(timeout=10)
    return out


def _refused_as_nobodys(pid: int) -> str:
    return (f"refused: another user's process (PID {pid} belongs to UID 65534/65534, not "
            f"{os.getuid()}): nothing was sent to it")


def test_cleanup_of_another_users_rank_sends_nothing_waits_for_nothing_and_fails() -> None:
    # It sent nothing, waited out the grace and the deadline, listed the PID twice in
    # not_removed, and returned as a success.
    tag = f"job-test-{uuid.uuid4().hex[:8]}"
    other = _nobodys_rank(tag, 1)
    try:
        started = time.monotonic()
        with pytest.raises(ActivityError, match=(
                f"^cleanup of tag '{tag}' removed none of the 1 process\\(es\\) it found: PID "
                f"{other.pid}: {re.escape(_refused_as_nobodys(other.pid))}$")):
            actions.cleanup_hung_job(tag=tag, grace_s=5, deadline_s=10)
        assert time.monotonic() - started < 3.0  # neither the grace nor the deadline waited
        assert other.poll() is None
    finally:
        assert _signals_received(other) == ""


def test_cleanup_removes_its_own_ranks_and_lists_another_users_once() -> None:
    tag = f"job-test-{uuid.uuid4().hex[:8]}"
    own = subprocess.Popen(["sleep", "60"], env=_rank_env(tag, 0), stdin=subprocess.DEVNULL)
    other = _nobodys_rank(tag, 1)
    try:
        started = time.monotonic()
        report = actions.cleanup_hung_job(tag=tag, grace_s=5, deadline_s=10)
        assert time.monotonic() - started < 3.0  # the grace ended at the own rank's exit
        assert report["removed"] == [own.pid] and report["reaped"] == [own.pid], report
        assert report["not_removed"] == [{"pid": other.pid, "reason_code": "other_user",
                                          "reason": _refused_as_nobodys(other.pid)}], report
        steps = {step["step"]: step for step in report["steps"]}
        assert list(steps) == ["thaw", "sigterm", "gpu_release"], report  # no SIGKILL
        assert steps["sigterm"]["sent"] == 1 and steps["sigterm"]["gone_in_grace"] is True
        assert other.poll() is None
    finally:
        own.kill()
        own.wait()
        assert _signals_received(other) == ""


def test_a_job_and_a_tag_that_disagree_are_an_error(ring: tuple[str, RingLaunch]) -> None:
    tag, _ = ring
    job_id = probes.job_state(tag=tag)["id"]
    assert probes.job_state(job=job_id, tag=tag)["id"] == job_id
    with pytest.raises(JobError, match="carries tag"):
        actions.kill_rank(job=job_id, tag="another-tag", rank=1)
    with pytest.raises(JobError, match="carries tag"):
        probes.job_hung(job=job_id, tag="another-tag")
    assert probes.job_state(tag=tag)["verdict"] == "running"  # nothing was signalled


def test_a_healthy_job_fails_detect_hang_when_a_hang_is_expected(
        ring: tuple[str, RingLaunch]) -> None:
    """expect_hang (a game-day that goes on only with a confirmed hang) fails the activity
    with the verdict it saw instead; without it the verdict is returned with a note."""
    tag, _ = ring
    found = probes.detect_hang(tag=tag, timeout_s=4)
    assert found["verdict"] == "running" and "no hang confirmed" in found["note"]
    with pytest.raises(JobError, match=r"no hang was confirmed.*running"):
        probes.detect_hang(tag=tag, timeout_s=4, expect_hang=True)
    with pytest.raises(ValueError, match="expect_hang must be true or false"):
        probes.detect_hang(tag=tag, timeout_s=4, expect_hang="yes")  # type: ignore[arg-type]


def _jobs_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chaosgpu.cli", "jobs", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_the_jobs_command_says_what_was_wrong(ring: tuple[str, RingLaunch]) -> None:
    """`chaosgpu jobs`: a selection that matches nothing is an error (exit 1), not an empty
    node; a job and tag that disagree and a non-finite window are usage errors (exit 2); no
    traceback in any case; the ring is untouched."""
    tag, _ = ring
    job_id = probes.job_state(tag=tag)["id"]
    missing = _jobs_cli("--tag", "no-such-tag-" + uuid.uuid4().hex[:6], "--observe", "0.5")
    assert missing.returncode == 1 and "is not running on this node" in missing.stderr
    assert "check the tag" in missing.stderr and "Traceback" not in missing.stderr
    disagree = _jobs_cli("--job", job_id, "--tag", "another-tag", "--observe", "0.5")
    assert disagree.returncode == 2 and "carries tag" in disagree.stderr, disagree.stderr
    assert "Traceback" not in disagree.stderr
    for option, value in (("--window", "nan"), ("--observe", "inf"), ("--window", "0")):
        bad = _jobs_cli(option, value)
        assert bad.returncode == 2 and f"argument {option}: must be" in bad.stderr, bad.stderr
    assert probes.job_state(tag=tag)["verdict"] == "running"


def test_a_job_running_before_the_watch_began_says_so(ring: tuple[str, RingLaunch]) -> None:
    """`chaosgpu jobs` on a ring that ran before it looked: "running" with `since` the first
    sight and `since_known` false (the text says "already when first seen"), not a claim that
    the job began running then."""
    tag, _ = ring
    text = _jobs_cli("--tag", tag, "--observe", "2")
    assert text.returncode == 0, text.stderr
    assert "RUNNING (already when first seen, " in text.stdout, text.stdout
    document = _jobs_cli("--tag", tag, "--observe", "2", "--json")
    [job] = json.loads(document.stdout)["jobs"]
    assert job["verdict"] == "running" and job["since_known"] is False, job
    assert time.time() - 10 < job["since"] <= time.time()


def test_jobs_watch_prints_verdict_changes_not_every_tick(ring: tuple[str, RingLaunch]) -> None:
    """`chaosgpu jobs --watch` on a healthy ring: a line when the job is first seen and at most
    one more (its first progress), not a line per tick as the reason's figures move."""
    tag, _ = ring
    watch = subprocess.Popen([sys.executable, "-m", "chaosgpu.cli", "jobs", "--watch",
                              "--tag", tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        time.sleep(8)
    finally:
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=20)
    lines = out.splitlines()
    assert 1 <= len(lines) <= 2 and "RUNNING" in lines[-1], (lines, err[-2000:])
    assert watch.returncode == 0


def test_a_job_seen_by_job_ranks_may_be_missing_once_it_ended(tmp_path: Path) -> None:
    """job_ranks remembers the jobs it found: after the job ended (its ranks died, as in the
    memory-pressure baseline), missing_ok "before-method" accepts it missing; a tag this run
    never saw still fails (a typo is not an ended job)."""
    from chaosgpu.timeline.sampler import Sampler, install, uninstall

    tag = f"job-test-{uuid.uuid4().hex[:8]}"
    launch = launch_ring(RingConfig(backend="gloo", world_size=2, ready_dir=str(tmp_path),
                                    tag=tag, timeout_s=60, log_dir=str(tmp_path / "logs")),
                         detach=True)
    sampler = Sampler(rate_hz=10, source="host-rss", scope={"tag": tag})
    try:
        launch.wait_ready(90)
        assert [r["rank"] for r in probes.job_ranks(tag=tag)] == [0, 1]
        _stop(launch)
        sampler.start()
        install(sampler)
        sampler.mark("method", "start")  # after the method started: only a seen job may miss
        assert probes.job_ranks(tag=tag, missing_ok="before-method") == []
        with pytest.raises(JobError, match="not running"):
            probes.job_ranks(tag=f"nope-{uuid.uuid4().hex}", missing_ok="before-method")
    finally:
        uninstall(sampler)
        sampler.stop()
        _stop(launch)
    assert all(proc.poll() is not None for proc in launch.processes)
