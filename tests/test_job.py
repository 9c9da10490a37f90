"""Jobs on real gloo rings: fail/kill/freeze a rank, hang detection within a second, hang
cleanup that leaves nothing alive and is idempotent; bad input."""

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from chaosgpu.job import actions, hang, probes  # noqa: E402
from chaosgpu.workloads.ring import RingConfig, RingLaunch, launch_ring  # noqa: E402


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
        for proc in launch.processes:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, 18)  # SIGCONT, then kill
                except OSError:
                    pass
                proc.kill()
            proc.wait(timeout=10)


def test_frozen_rank_is_detected_within_a_second_and_cleaned_up(
        ring: tuple[str, RingLaunch]) -> None:
    tag, launch = ring
    assert probes.job_hung(tag=tag) is False
    assert [r["state"] for r in probes.job_ranks(tag=tag)] == ["alive"] * 3
    failed = actions.fail_rank(tag=tag, rank=1)
    assert failed["backend"] == "gloo" and failed["done"] == "freeze"
    t_fault = time.time()
    found = probes.detect_hang(tag=tag, timeout_s=10)
    assert found["hung"] is True
    assert found["frozen_ranks"] == [1] and found["survivor_ranks"] == [0, 2]
    assert found["first_seen"] - t_fault < 1.0
    assert {s["rank"] for s in found["survivors"]} == {0, 2}
    stacks = found["python_stacks"]
    assert stacks["available"] in (True, False)
    if stacks["available"]:
        assert len(stacks["stacks"]) == 3
    assert probes.job_hung(tag=tag) is True
    started = time.monotonic()
    report = actions.cleanup_hung_job(tag=tag, grace_s=2, deadline_s=20)
    assert time.monotonic() - started < 5.0
    assert report["not_removed"] == [], report
    assert sorted(report["removed"]) == sorted(launch.pids)
    for proc in launch.processes:
        assert proc.poll() is not None or proc.wait(timeout=5) is not None
    again = actions.cleanup_hung_job(tag=tag)
    assert again["found"] == 0 and "nothing to clean up" in again["note"]


def test_killed_gloo_rank_and_freeze_resume(ring: tuple[str, RingLaunch]) -> None:
    tag, launch = ring
    frozen = actions.freeze_rank(tag=tag, rank=2)
    assert frozen["result"] == "sent" and frozen["method"] == "sigstop"
    resumed = actions.resume_rank(tag=tag, rank=2)
    assert resumed["result"] == "sent"
    assert probes.job_hung(tag=tag) is False
    killed = actions.kill_rank(tag=tag, rank=0, signal="SIGKILL", wait_s=5)
    assert killed["result"] == "sent" and killed["wait"]["all_gone"]
    report = actions.cleanup_hung_job(tag=tag, grace_s=2, deadline_s=20)
    assert report["not_removed"] == [], report


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/sys/fs/cgroup/freezer/cgroup.procs"),
                    reason="needs root and the cgroup v1 freezer")
def test_rank_frozen_by_the_freezer_is_detected_and_cleaned(
        ring: tuple[str, RingLaunch]) -> None:
    tag, launch = ring
    frozen = actions.freeze_rank(tag=tag, rank=1, method="freezer")
    assert frozen["freezer_state"] == "FROZEN" and frozen["frozen"] == [frozen["pid"]]
    found = probes.detect_hang(tag=tag, timeout_s=10, stacks=False)
    assert found["hung"] is True and found["frozen_ranks"] == [1], found
    # A frozen process ignores SIGKILL until thawed: the cleanup must thaw first.
    report = actions.cleanup_hung_job(tag=tag, grace_s=1, deadline_s=20)
    assert report["not_removed"] == [], report
    assert report["steps"][0]["thawed_cgroups"], report
    assert sorted(report["removed"]) == sorted(launch.pids)


def test_survivors_exit_on_their_own_with_a_short_group_timeout(tmp_path: Path) -> None:
    tag = f"job-test-{uuid.uuid4().hex[:8]}"
    launch = launch_ring(RingConfig(backend="gloo", world_size=3, ready_dir=str(tmp_path),
                                    tag=tag, timeout_s=3, log_dir=str(tmp_path / "logs")),
                         detach=True)
    try:
        launch.wait_ready(90)
        job_id = actions.fail_rank(tag=tag, rank=0)["job"]
        from chaosgpu.scope import resolve_scope

        assert len(resolve_scope({"job": job_id})) == 3
        short = probes.wait_survivors_exit(tag=tag, timeout_s=0.5)
        assert short["all_exited"] is False and short["survivors"] == [1, 2]
        waited = probes.wait_survivors_exit(tag=tag, timeout_s=60)
        assert waited["all_exited"] is True, waited
        assert set(waited["exited_after_s"]) == {"1", "2"}
        report = actions.cleanup_hung_job(tag=tag, grace_s=1, deadline_s=20)
        assert report["not_removed"] == [], report
        gone = probes.wait_survivors_exit(tag=tag, timeout_s=1)
        assert gone["all_exited"] is True
    finally:
        for proc in launch.processes:
            if proc.poll() is None:
                os.kill(proc.pid, 18)
                proc.kill()
            proc.wait(timeout=10)


def test_bad_job_input_is_refused() -> None:
    with pytest.raises(hang.JobError, match="name the job"):
        actions.kill_rank()
    with pytest.raises(ValueError, match="rank must be a non-negative integer"):
        actions.kill_rank(tag="x", rank=-1)
    with pytest.raises(hang.JobError, match="not running"):
        actions.kill_rank(job=f"nope-{uuid.uuid4().hex}", rank=0)
    with pytest.raises(ValueError, match="how must be"):
        actions.fail_rank(tag="x", how="explode")
    with pytest.raises(hang.JobError, match="non-empty string"):
        probes.detect_hang(tag="")
    quiet = probes.detect_hang(tag=f"nope-{uuid.uuid4().hex}", timeout_s=0.2)
    assert quiet["hung"] is False and "no such job" in quiet["note"]
    nothing = actions.cleanup_hung_job(tag=f"nope-{uuid.uuid4().hex}")
    assert nothing["found"] == 0
