"""Verdicts on real 2-rank torchrun gloo jobs whose ranks sleep next to a collective or poll
their collective's work in a loop (chaosgpu.job.stacks reads where they wait):

* a healthy, slow job, `dist.all_reduce(t)` then `time.sleep(5)` every step, is never `hung`
  (before, the sleeping ranks read as waiting in all_reduce, the line above, and the job went
  hung, running, hung with a 3 s window);
* a job deadlocked at a step (the ranks all_reduce on different groups) whose ranks poll
  `while not work.is_completed(): polls += 1; time.sleep(0.05)` becomes `hung` (before, the
  poll counter was read as the stack moving: running forever).

The jobs are scripts written here; every process is killed at the end and proven gone."""

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from proc_helpers import tagged

pytest.importorskip("torch")

from jobs.launch import Job, _env, free_port  # noqa: E402

from chaosgpu.job.observe import Observer  # noqa: E402

pytestmark = pytest.mark.slow

HEAD = """\
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from datetime import timedelta


def write_progress(rank, step):
    path = os.path.join(sys.argv[1], f"rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump({"step": step, "pid": os.getpid()}, handle)
    os.replace(path + ".tmp", path)

"""

SLOW = HEAD + """
def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    t = torch.ones(4096)
    step = 0
    while True:
        step += 1
        write_progress(rank, step)
        dist.all_reduce(t)
        time.sleep(5)


main()
"""

DEADLOCK_AT = 3
DEADLOCK = HEAD + f"""
def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    other = dist.new_group([0, 1])
    t = torch.ones(4096)
    for step in range(1, 10**6):
        write_progress(rank, step)
        group = other if step == {DEADLOCK_AT} and rank == 0 else None
        work = dist.all_reduce(t, group=group, async_op=True)
        polls = 0
        while not work.is_completed():
            polls += 1
            time.sleep(0.05)
        time.sleep(0.2)


main()
"""


def start_job(workdir: Path, script: str) -> Job:
    """torchrun --nproc-per-node 2 (c10d rendezvous on loopback) running `script`."""
    path = workdir / "job.py"
    path.write_text(script)
    tag = f"verdict-{uuid.uuid4().hex[:8]}"
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    job = Job(run_id, tag, workdir)
    job.progress_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--max-restarts=0", "--monitor-interval=0.1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}", str(path),
            str(job.progress_dir)]
    with open(workdir / "torchrun.log", "wb") as log:
        job.processes.append(subprocess.Popen(argv, env=_env(tag), stdout=log, stderr=log,
                                              stdin=subprocess.DEVNULL,
                                              start_new_session=True))
    return job


def watch(observer: Observer, seconds: float, stop: Any = None) -> list[tuple[float, str, str]]:
    """Tick for `seconds` (or until `stop(track)`): every verdict change, (time, verdict,
    reason)."""
    seen: list[tuple[float, str, str]] = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        observer.tick()
        for track in observer.tracks.values():
            if not seen or seen[-1][1] != track.verdict:
                seen.append((round(time.monotonic() - started, 1), track.verdict, track.reason))
            if stop is not None and stop(track):
                return seen
        time.sleep(observer.tick_s)
    return seen


def stop_and_prove_gone(job: Job) -> None:
    job.stop()
    assert all(proc.poll() is not None for proc in job.processes)
    deadline = time.monotonic() + 20
    while tagged(job.tag, live_only=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged(job.tag, live_only=True) == []


def test_all_reduce_then_sleep_5_s_is_never_hung(tmp_path: Path, jobs: list[Job]) -> None:
    """Both ranks sleep 5 s after each all_reduce, longer than the 3 s window: over 16 s of
    watching (three such sleeps) the verdict is never hung; nothing waits in all_reduce."""
    job = start_job(tmp_path, SLOW)
    jobs.append(job)
    job.wait_steps(1, timeout_s=180)
    observer = Observer(job=job.run_id, window_s=3.0)
    try:
        seen = watch(observer, 16.0)
        track = next(iter(observer.tracks.values()), None)
        history = track.history if track is not None else None
        sites = [r.site for r in track.current_ranks()] if track is not None else []
    finally:
        observer.close()
    steps = job.progress()
    try:
        assert seen, "the job was never seen"
        assert "hung" not in [verdict for _, verdict, _ in seen], (seen, history)
        assert all(site is None or site.what != "all_reduce" for site in sites), sites
        assert min(p["step"] for p in steps.values()) >= 3, steps  # it did go on meanwhile
    finally:
        stop_and_prove_gone(job)


def test_a_deadlock_polled_with_a_counter_becomes_hung(tmp_path: Path, jobs: list[Job]) -> None:
    """At step 3 rank 0 all_reduces on a new group, rank 1 on the world: each polls its work
    forever, counting. Within 20 s of both reaching the step the verdict is hung, both ranks
    blocked in is_completed() at the poll loop."""
    job = start_job(tmp_path, DEADLOCK)
    jobs.append(job)
    job.wait_steps(DEADLOCK_AT, timeout_s=180)
    observer = Observer(job=job.run_id, window_s=3.0)
    try:
        seen = watch(observer, 20.0, stop=lambda t: t.verdict == "hung")
        track = next(iter(observer.tracks.values()), None)
        history = track.history if track is not None else None
        sites = [r.site for r in track.current_ranks()] if track is not None else []
    finally:
        observer.close()
    try:
        assert seen and seen[-1][1] == "hung", (seen, history, job.logs())
        assert len(sites) == 2 and all(
            site is not None and site.what == "is_completed()" and site.loop is not None
            for site in sites), sites
        assert "is_completed()" in seen[-1][2], seen[-1]
        assert {p["step"] for p in job.progress().values()} == {DEADLOCK_AT}, job.progress()
    finally:
        stop_and_prove_gone(job)
