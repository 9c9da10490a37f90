"""Rank states from real processes without torch: missing ranks, a cgroup-frozen rank (v1
freezer or v2 cgroup.freeze), zombie ranks (one reading: no verdict)."""

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from census_helpers import wait_for

from chaosgpu import node

census_module = node.census_module()


@contextlib.contextmanager
def ranks(job: str, ranks_: list[int], world: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(["sleep", "60"], env=dict(
        os.environ, CHAOSGPU_JOB=job, MASTER_ADDR="127.0.0.1", MASTER_PORT="29999",
        RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world))) for r in ranks_]
    try:
        for proc in procs:
            wait_for(lambda p=proc: (node.read_process(p.pid) or {}).get("env", {}) or None,
                     what="exec")
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _job(job: str, cache: bool = False) -> dict:
    return next(j for j in node.take_census(gpu=False, cache=cache)["jobs"] if j["id"] == job)


def test_missing_rank_with_a_survivor_is_a_suspected_hang() -> None:
    job = f"missing-{os.environ['CHAOSGPU_TEST_ID']}"
    with ranks(job, [0], world=2):
        found = _job(job)
        assert found["expected_ranks"] == [0, 1] and found["launcher"] == "bare"
        assert [(r["rank"], r["state"]) for r in found["ranks"]] == [(0, "alive"), (1, "missing")]
        assert found["dead"] == [1] and found["survivors"] == [0]


def test_healthy_job_and_a_zombie_rank() -> None:
    job = f"zombie-{os.environ['CHAOSGPU_TEST_ID']}"
    with ranks(job, [0, 1], world=2) as procs:
        found = _job(job)
        assert [r["state"] for r in found["ranks"]] == ["alive", "alive"]
        assert "hang_suspected" not in found  # a verdict needs time: chaosgpu.job
        os.kill(procs[1].pid, signal.SIGKILL)
        wait_for(lambda: node.process_state(procs[1].pid) == "Z", what="zombie")
        found = _job(job)
        # the zombie's env is gone: rank 1 is missing (no launcher to infer it from)
        assert {r["rank"]: r["state"] for r in found["ranks"]} == {0: "alive", 1: "missing"}


def _freezer() -> tuple[Path, str] | None:
    v1 = Path("/sys/fs/cgroup/freezer")
    if (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK):
        return v1, "v1"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and os.access(v2, os.W_OK):
        return v2, "v2"
    return None


@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached-before-the-freeze"])
def test_cgroup_frozen_rank_is_frozen(cached: bool) -> None:
    """A rank moved into a frozen cgroup reads frozen, also in a cached census (the job
    observer's) that knew the rank before it was moved: a cgroup is read where it matters, not
    kept for a process's life."""
    found = _freezer()
    if found is None or os.geteuid() != 0:
        pytest.skip("needs root and a writable cgroup freezer")
    root, version = found
    # not "chaosgpu-*": chaosgpu removes its own empty freezer groups of that name host-wide
    group = root / f"census-test-{os.environ['CHAOSGPU_TEST_ID']}"
    job = f"frozen-{int(cached)}-{os.environ['CHAOSGPU_TEST_ID']}"
    group.mkdir()
    try:
        with ranks(job, [0, 1], world=2) as procs:
            if cached:  # known to the cache (from 2 s of age), as alive, before the move
                time.sleep(2.2)
                _job(job, cache=True)
                before = _job(job, cache=True)
                assert [r["state"] for r in before["ranks"]] == ["alive", "alive"]
                key = ("/proc", procs[1].pid, before["ranks"][1]["starttime"])
                assert key in census_module._CACHE
            (group / "cgroup.procs").write_text(str(procs[1].pid))
            if version == "v1":
                (group / "freezer.state").write_text("FROZEN")
                wait_for(lambda: (group / "freezer.state").read_text().strip() == "FROZEN",
                         what="frozen")
            else:
                (group / "cgroup.freeze").write_text("1")
                wait_for(lambda: "frozen 1" in (group / "cgroup.events").read_text(),
                         what="frozen")
            try:
                state = _job(job, cache=cached)
                assert {r["rank"]: r["state"] for r in state["ranks"]} == {0: "alive",
                                                                           1: "frozen"}
                assert state["frozen"] == [1]
            finally:
                if version == "v1":
                    (group / "freezer.state").write_text("THAWED")
                else:
                    (group / "cgroup.freeze").write_text("0")
    finally:
        wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), what="empty group")
        group.rmdir()
