"""Rollbacks given a name that matches nothing: a sandbox, workload tag or job this run never
met fails ("a typo?", naming the value and what exists) instead of succeeding while the real
one is left running. One this run started and already removed is fine (safe to run twice), and
missing_ok decides as for the probes (chaosgpu.arguments.missing_allowed: "before-method", the
default, accepts absence until the experiment's method starts). Processes are real and proven
gone afterwards (the autouse fixture checks every one carrying the test id)."""

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from proc_helpers import alive, wait_until

from chaosgpu.errors import ActivityError, InvalidArgument
from chaosgpu.job import actions as job_actions
from chaosgpu.job.observe import JobError
from chaosgpu.sandbox import actions as sandbox_actions
from chaosgpu.sandbox import probes as sandbox_probes
from chaosgpu.sandbox import runtime
from chaosgpu.timeline.sampler import Sampler, install, uninstall
from chaosgpu.workloads import actions as workload_actions


@contextmanager
def method(started: bool) -> Iterator[None]:
    """The experiment's timeline as its control installs it, before or after the method's
    start (what "before-method" reads)."""
    sampler = Sampler(rate_hz=20, source="host-rss")
    sampler.start()
    install(sampler)
    try:
        if started:
            sampler.mark("method", "start")
        yield
    finally:
        uninstall(sampler)
        sampler.stop()


def _names() -> tuple[str, str]:
    """A name and its typo (a letter dropped, as in `zombie-pod-slep`), unique to this test."""
    suffix = uuid.uuid4().hex[:8]
    return f"rb-sleep-{suffix}", f"rb-slep-{suffix}"


def test_remove_sandbox_refuses_a_name_this_run_never_created() -> None:
    name, typo = _names()
    sandbox_actions.create_sandbox(name, grace_s=1)
    try:
        with method(started=True):
            with pytest.raises(ActivityError, match=(
                    rf"no sandbox named '{typo}' is recorded, and this run never created it: a "
                    rf"typo\? Recorded sandboxes: \[[^]]*'{name}'")):
                sandbox_actions.remove_sandbox(typo)
            assert sandbox_probes.sandbox_exists(name)  # the real pod was left alone
            assert sandbox_actions.remove_sandbox(typo, missing_ok=True)["removed"] is False
            with pytest.raises(InvalidArgument, match="missing_ok must be true, false or"):
                sandbox_actions.remove_sandbox(name, missing_ok="sometimes")
            assert sandbox_probes.sandbox_exists(name)
            assert sandbox_actions.remove_sandbox(name)["removed"] is True
            assert sandbox_actions.remove_sandbox(name)["removed"] is False  # twice: fine
        with method(started=False):  # before the method nothing is expected to exist yet
            assert sandbox_actions.remove_sandbox(typo)["removed"] is False
    finally:
        runtime.remove(name)
    assert not sandbox_probes.sandbox_exists(name)


def test_stop_workload_refuses_a_tag_this_run_never_met() -> None:
    tag, typo = _names()
    started = workload_actions.start_holders(count=1, mib=1, via="host", tag=tag)
    try:
        with method(started=True):
            with pytest.raises(ActivityError, match=(
                    rf"no workload tagged '{typo}' is recorded, and this run never met that tag "
                    rf".*a typo\? Recorded workloads: \[[^]]*'{tag}'")):
                workload_actions.stop_workload(typo, grace_s=0)
            assert all(alive(pid) for pid in started["pids"])  # left alone
            assert workload_actions.stop_workload(typo, missing_ok=True)["stopped"] is False
            with pytest.raises(InvalidArgument, match="missing_ok must be true, false or"):
                workload_actions.stop_workload(tag, missing_ok="sometimes")
            assert all(alive(pid) for pid in started["pids"])
            assert workload_actions.stop_workload(tag, grace_s=0)["stopped"] is True
            again = workload_actions.stop_workload(tag)  # twice: this run started it
            assert again["stopped"] is False and "it ended" in again["note"]
        with method(started=False):
            assert workload_actions.stop_workload(typo)["stopped"] is False
    finally:
        workload_actions.stop_workload(tag, grace_s=0)
    assert not any(alive(pid) for pid in started["pids"])


def _rank(job_id: str, tag: str) -> subprocess.Popen[bytes]:
    """A real process that the census takes for rank 0 of job `job_id`, tagged `tag`."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29931", CHAOSGPU_JOB=job_id, CHAOSGPU_TAG=tag)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                            stdin=subprocess.DEVNULL)
    needle = f"CHAOSGPU_TAG={tag}".encode()
    assert wait_until(lambda: needle in open(f"/proc/{rank.pid}/environ", "rb").read())
    return rank


@pytest.mark.parametrize("kind", ["tag", "job"])
def test_cleanup_hung_job_refuses_a_job_this_run_never_met(kind: str) -> None:
    tag, typo = _names()
    job_id = f"{tag}-job"
    real = tag if kind == "tag" else job_id
    rank = _rank(job_id, tag)
    try:
        with method(started=True):
            with pytest.raises(JobError, match=(
                    rf"{kind} '{typo}' matches no process, and this run never met it .*: a "
                    rf"typo\? Jobs on this node: \[[^]]*{re.escape(job_id)} \(tag '{tag}'\)")):
                job_actions.cleanup_hung_job(**{kind: typo}, grace_s=0, deadline_s=5)
            assert alive(rank.pid)  # left alone
            assert job_actions.cleanup_hung_job(**{kind: typo}, missing_ok=True)["found"] == 0
            with pytest.raises(InvalidArgument, match="missing_ok must be true, false or"):
                job_actions.cleanup_hung_job(**{kind: real}, missing_ok="sometimes")
            assert alive(rank.pid)
            report = job_actions.cleanup_hung_job(**{kind: real}, grace_s=1, deadline_s=10)
            assert report["removed"] == [rank.pid] and report["not_removed"] == [], report
            again = job_actions.cleanup_hung_job(**{kind: real})  # twice: it met the job
            assert again["found"] == 0 and "nothing to clean up" in again["note"]
        with method(started=False):
            assert job_actions.cleanup_hung_job(**{kind: typo})["found"] == 0
    finally:
        rank.kill()
        rank.wait()
    assert not alive(rank.pid)
