"""What counts as a job's progress, on real gloo jobs (tests/jobs/train.py) and real signals:
only bytes on connections to the job's own ranks count, never a metrics heartbeat to a local
collector; bytes written into a stopped peer's socket buffer are no progress either. And a ring
started with `chaosgpu workload ring --detach` is found and judged by job_stalled."""

import json
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

from jobs.launch import TRAIN, Job, free_port, start_torchrun  # noqa: E402
from proc_helpers import tagged  # noqa: E402

from chaosgpu.gpu import probes as gpu_probes  # noqa: E402
from chaosgpu.job import actions, probes  # noqa: E402
from chaosgpu.job.observe import Observer  # noqa: E402

pytestmark = pytest.mark.slow

#: a local metrics collector (wandb's local service, statsd, a metrics sidecar): it accepts
#: connections and reads whatever comes, in its own process
COLLECTOR = """
import socket, sys, threading
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(16)
print(server.getsockname()[1], flush=True)
def drain(conn):
    while conn.recv(4096):
        pass
while True:
    conn, _ = server.accept()
    threading.Thread(target=drain, args=(conn,), daemon=True).start()
"""

#: runs tests/jobs/train.py unchanged, with a metrics client thread that sends a heartbeat to
#: the collector every 0.2 s (as a wandb or statsd client in a trainer does)
WITH_HEARTBEAT = """
import os, runpy, socket, sys, threading, time
def beat():
    conn = socket.create_connection(("127.0.0.1", int(os.environ["HEARTBEAT_PORT"])))
    while True:
        conn.sendall(b"heartbeat\\n")
        time.sleep(0.2)
threading.Thread(target=beat, daemon=True, name="metrics").start()
train = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(train, run_name="__main__")
"""


def stop_and_prove_gone(job: Job, *others: subprocess.Popen[bytes]) -> None:
    job.stop()
    for proc in others:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while tagged(job.tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged(job.tag) == [], f"processes of {job.tag} left behind"
    assert all(p.poll() is not None for p in [*job.processes, *others])


def start_collector(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    script = workdir / "collector.py"
    script.write_text(COLLECTOR)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def start_bare_with_heartbeat(workdir: Path, port: int, args: list[str]) -> Job:
    """Two bare gloo ranks of train.py, each with a heartbeat thread to the collector."""
    wrapper = workdir / "with_heartbeat.py"
    wrapper.write_text(WITH_HEARTBEAT)
    tag = f"verdict-{uuid.uuid4().hex[:8]}"
    master = free_port()
    job = Job(f"127.0.0.1:{master}", tag, workdir, world_size=2)
    job.progress_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(2):
        env = dict(os.environ, CHAOSGPU_TAG=tag, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), HEARTBEAT_PORT=str(port))
        env.pop("TORCHELASTIC_RUN_ID", None)
        with open(workdir / f"rank{rank}.log", "wb") as log:
            job.processes.append(subprocess.Popen(
                [sys.executable, str(wrapper), str(TRAIN), "--progress-dir",
                 str(job.progress_dir), *args],
                env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                start_new_session=True))
    return job


def heartbeat_connections(pid: int, port: int) -> int:
    """How many of `pid`'s established connections go to the collector's port (ss)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", f"dport = :{port}"],
                         capture_output=True, text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if f"pid={pid}," in line)


def test_a_metrics_heartbeat_is_no_progress_and_a_stopped_peer_hangs_the_job(
        tmp_path: Path, jobs: list[Job]) -> None:
    collector, port = start_collector(tmp_path)
    job = start_bare_with_heartbeat(tmp_path, port, ["--sleep-s", "0.2"])
    jobs.append(job)
    try:
        job.wait_steps(3)
        assert all(heartbeat_connections(p.pid, port) == 1 for p in job.processes), \
            "each rank's heartbeat is connected to the collector"
        # healthy, with its heartbeat: running, never hung
        observer = Observer(job=job.run_id)
        try:
            seen = []
            end = time.monotonic() + 5
            while time.monotonic() < end:
                observer.tick()
                (track,) = observer.tracks.values()
                seen.append(track.verdict)
                time.sleep(observer.tick_s)
        finally:
            observer.close()
        assert "hung" not in seen and seen[-1] == "running", (seen, track.reason)
        # rank 1 stopped: rank 0 waits in all_reduce forever while its heartbeat still sends
        froze = actions.freeze_rank(1, job=job.run_id)
        found = probes.detect_hang(job=job.run_id, timeout_s=15, window_s=3)
        assert found["verdict"] == "hung", found["reason"]
        assert found["blocked_in"]["what"] == "all_reduce", found["blocked_in"]
        (culprit,) = found["culprit_ranks"]
        assert culprit["rank"] == 1 and culprit["why"].startswith("stopped"), culprit
        assert heartbeat_connections(job.processes[0].pid, port) == 1, \
            "the heartbeat kept sending through the hang"
        os.kill(froze["pid"], signal.SIGCONT)
        # what the healthy watch saw: the training connection is its peers', the heartbeat not
        for rank in track.current_ranks():
            assert rank.net["peer_connections"] >= 1, rank.net
            assert rank.net.get("other_connections", 0) >= 1, rank.net
    finally:
        stop_and_prove_gone(job, collector)


@pytest.mark.parametrize("method", ["sigstop", "freezer"])
def test_bytes_into_a_stopped_peer_are_no_progress_right_after_the_freeze(
        method: str, tmp_path: Path, jobs: list[Job]) -> None:
    # steps 1 s apart: rank 0 enters its next all_reduce (192 bytes into rank 1's receive
    # buffer, acknowledged by the kernel) while job_state watches
    job = start_torchrun(tmp_path, ["--sleep-s", "1.0"])
    jobs.append(job)
    try:
        job.wait_steps(2)
        for attempt in range(2):
            step = job.progress()[0]["step"]
            deadline = time.monotonic() + 10
            while job.progress()[0]["step"] == step and time.monotonic() < deadline:
                time.sleep(0.01)  # freeze right after a step: the next one is a second away
            froze = actions.freeze_rank(1, job=job.run_id, method=method)
            state = probes.job_state(job=job.run_id, window_s=3)
            assert state["verdict"] in ("hung", "unknown"), (attempt, state["reason"])
            ranks: dict[int, dict[str, Any]] = {r["rank"]: r for r in state["ranks"]}
            assert ranks[1]["state"] == ("stopped" if method == "sigstop" else "frozen")
            assert "bytes crossed" not in str(ranks[0]["progress"]), ranks[0]
            resumed = actions.resume_rank(1, job=job.run_id)
            assert resumed["pid"] == froze["pid"]
            job.wait_steps(job.progress()[0]["step"] + 2)
        # resumed: the same job runs again, with its bytes to the live peer as progress
        state = probes.job_state(job=job.run_id, window_s=3)
        assert state["verdict"] == "running", state["reason"]
    finally:
        if method == "freezer":
            actions.resume_rank("any", job=job.run_id)
        stop_and_prove_gone(job)
    left = [str(p) for p in Path("/sys/fs/cgroup").rglob(f"*{job.run_id}*")]
    assert left == [], f"freezer cgroups left behind: {left}"


def test_job_stalled_finds_and_judges_a_detached_ring(tmp_path: Path) -> None:
    tag = f"ring-{uuid.uuid4().hex[:8]}"
    # the documented way (docs/workloads.md), from another working directory, relative ready dir
    done = subprocess.run(
        [sys.executable, "-m", "chaosgpu.workloads", "ring", "--backend", "gloo",
         "--world-size", "2", "--tag", tag, "--job-id", tag, "--timeout-s", "60", "--detach",
         "--wait-ready-s", "60", "--ready-dir", "ready", "--iters-per-s", "20"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    pids = json.loads(done.stdout)["pids"] if done.stdout.strip() else []
    stranger = subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=f"{tag}-x"))
    try:
        assert done.returncode == 0, done.stderr
        assert len(pids) == 2
        assert gpu_probes.job_stalled(tag, window_s=1.5) is False  # every rank advanced
        os.kill(pids[1], signal.SIGSTOP)
        assert gpu_probes.job_stalled(tag, window_s=1.5) is True  # found and judged
        assert gpu_probes.job_stalled(tag, window_s=1.5, missing_ok=True) is True
        os.kill(pids[1], signal.SIGCONT)
        # a live process carrying a tag that is no readable ring: never "no such ring"
        with pytest.raises(gpu_probes.NotAReadableRing, match="no ring step counter"):
            gpu_probes.job_stalled(f"{tag}-x", window_s=0.5, missing_ok=True)
        # nothing carries the tag: missing_ok decides, as before
        assert gpu_probes.job_stalled(f"{tag}-gone", window_s=0.5, missing_ok=True) is False
        with pytest.raises(ValueError, match="this run never met that tag"):
            gpu_probes.job_stalled(f"{tag}-gone", window_s=0.5, missing_ok=False)
    finally:
        stranger.kill()
        stranger.wait(timeout=10)
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        while (tagged(tag) or tagged(f"{tag}-x")) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert tagged(tag) == [] and tagged(f"{tag}-x") == [], "ring processes left behind"
