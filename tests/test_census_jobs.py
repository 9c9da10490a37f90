"""The census finds a real 2-rank gloo job started by torchrun: job id, launcher, ranks, states;
a SIGSTOPped rank is reported stopped and the job hang-suspected."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from census_helpers import wait_for
from proc_helpers import alive, wait_until

from chaosgpu import node
from chaosgpu.job import probes as job_probes
from chaosgpu.job.observe import Observer
from chaosgpu.node import probes

pytest.importorskip("torch")

WORKER = Path(__file__).with_name("census_ring_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def torchrun_job(run_id: str | None) -> Iterator[subprocess.Popen[bytes]]:
    """A 2-rank torchrun job of census_ring_worker.py: c10d rendezvous with `run_id`, or, for
    None, torchrun's defaults (static rendezvous on a free `--master-port`, no `--rdzv-id`:
    the ranks' run id is "none", their job is named `127.0.0.1:<port>`). Killed at the end."""
    torchrun = Path(sys.executable).parent / "torchrun"
    port = _free_port()
    rendezvous = ["--master-port", str(port)] if run_id is None else [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    job_id = run_id or f"127.0.0.1:{port}"
    launcher = subprocess.Popen(
        [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", *rendezvous,
         "--max-restarts", "0", str(WORKER), "--seconds", "90"],
        env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield launcher
    finally:
        # torchrun may put workers in their own process groups: kill them by job, then the agent
        with contextlib.suppress(OSError):
            os.killpg(launcher.pid, signal.SIGKILL)
        for _ in range(100):
            job = _job(job_id)
            pids = [r["pid"] for r in (job or {}).get("ranks", []) if r["pid"]]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        launcher.wait(timeout=30)


def _job(run_id: str) -> dict | None:
    return next((j for j in node.take_census(gpu=False)["jobs"] if j["id"] == run_id), None)


def _running(run_id: str) -> dict | None:
    job = _job(run_id)
    if job and len(job["ranks"]) == 2 and job["survivors"] == [0, 1]:
        return job
    return None


@pytest.mark.slow
def test_torchrun_gloo_job_ranks_and_a_stopped_rank() -> None:
    run_id = f"census-{os.environ['CHAOSGPU_TEST_ID']}"
    with torchrun_job(run_id) as launcher:
        job = wait_for(lambda: _running(run_id), timeout=120, what="both ranks to run")
        assert job["launcher"] == "torchrun" and job["launcher_pid"] == launcher.pid
        assert job["world_size"] == 2 and job["expected_ranks"] == [0, 1]
        assert job["master"] is not None
        assert [r["rank"] for r in job["ranks"]] == [0, 1]
        assert [r["local_rank"] for r in job["ranks"]] == [0, 1]
        pids = [r["pid"] for r in job["ranks"]]
        census = node.take_census(gpu=False)
        by_pid = {p["pid"]: p for p in census["processes"]}
        for pid in pids:
            assert by_pid[pid]["ppid"] == launcher.pid
            assert by_pid[pid]["env"]["TORCHELASTIC_RUN_ID"] == run_id
            assert not by_pid[pid]["orphan"]
        assert launcher.pid not in pids  # the agent is the launcher, not a rank
        assert job["dead"] == [] and job["frozen"] == []
        assert probes.hung_jobs() == [] or run_id not in probes.hung_jobs()
        # freeze rank 1: rank 0 blocks in all_reduce -> a hang in the making
        os.kill(pids[1], signal.SIGSTOP)
        job = wait_for(lambda: (j := _job(run_id)) and j["stopped"] == [1] and j,
                       timeout=10, what="the stopped rank to be seen")
        states = {r["rank"]: r["state"] for r in job["ranks"]}
        assert states == {0: "alive", 1: "stopped"}
        assert job["survivors"] == [0] and job["frozen"] == [1] and job["stopped"] == [1]
        assert run_id in probes.hung_jobs()
        ranks = job_probes.job_ranks(job=run_id)
        assert [r["state"] for r in ranks] == ["alive", "stopped"]
        # kill rank 0: a zombie until torchrun reaps it, then torchrun tears down the job
        os.kill(pids[1], signal.SIGCONT)
        os.kill(pids[0], signal.SIGKILL)
        wait_for(lambda: (j := _job(run_id)) is None or 0 in j["dead"] or None,
                 timeout=30, what="rank 0 to be seen dead or the job to end")
    assert _job(run_id) is None


def test_job_ranks_of_an_unknown_job_is_empty_and_no_selector_is_refused() -> None:
    assert job_probes.job_ranks(job="nope-nope", missing_ok=True) == []
    with pytest.raises(ValueError):
        job_probes.job_ranks(job="nope-nope")
    with pytest.raises(ValueError):
        job_probes.job_ranks()


# A stand-in for a rendezvous store's shape, without torch.distributed: "host" opens STORES
# listeners and (unless told "alone") connects to each itself, as a TCPStore's rank 0 does;
# "client PORT..." connects to each. Each runs a second thread, as a process group's ranks do
# (importing torch alone starts one).
STORE_SHAPE = r"""
import select, socket, sys, threading
if sys.argv[1] == "torch":
    import torch  # noqa: F401  (its libraries mapped, as a trainer has them)
threading.Thread(target=threading.Event().wait, daemon=True).start()
held = []
if sys.argv[2] == "host":
    servers = []
    for _ in range(int(sys.argv[4])):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        servers.append(server)
        if sys.argv[3] == "self":
            held.append(socket.create_connection(("127.0.0.1", server.getsockname()[1])))
    print(" ".join(str(server.getsockname()[1]) for server in servers), flush=True)
    while True:
        for server in select.select(servers, [], [])[0]:
            held.append(server.accept()[0])
else:
    for port in sys.argv[3:]:
        held.append(socket.create_connection(("127.0.0.1", int(port))))
    print("connected", flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def shape_processes() -> Iterator[Callable[..., tuple[int, str]]]:
    """A starter of `python -c SCRIPT ARGS...` processes: each call starts one (environment
    `env` when given) and returns its PID and the first line it prints; every process started
    is killed after."""
    started: list[subprocess.Popen[str]] = []

    def start(script: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        started.append(proc)
        assert proc.stdout is not None
        return proc.pid, proc.stdout.readline().strip()

    try:
        yield start
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def store_shape(torch: bool, self_connected: bool, stores: int = 1) -> Iterator[list[int]]:
    """A host of `stores` listeners and two clients of each; yields the ports, in the order
    they were opened; kills the processes after."""
    mode = "torch" if torch else "plain"
    with shape_processes() as start:
        _, line = start(STORE_SHAPE, mode, "host", "self" if self_connected else "alone",
                        str(stores))
        ports = [int(port) for port in line.split()]
        for _ in range(2):
            assert start(STORE_SHAPE, mode, "client", *map(str, ports))[1] == "connected"
        yield ports


@pytest.mark.slow
def test_only_torchs_store_shape_is_a_job_found_by_its_connections() -> None:
    """A job no environment names is found by its store's connections (the store's host
    connected to itself, other processes to it, torch mapped in all): the same shape without
    torch, or without the host's own connection, is no job. Two stores of the same processes
    (a TCPStore, then NCCL's bootstrap root for a moment) are one job, named by the first."""
    for torch, self_connected, stores, expected in (
            (False, True, 1, False), (True, False, 1, False), (True, True, 1, True),
            (True, True, 2, True)):
        with store_shape(torch, self_connected, stores) as ports:
            ids = {f"127.0.0.1:{port}" for port in ports}
            jobs = [j for j in node.take_census(gpu=False)["jobs"] if j["id"] in ids]
            assert len(jobs) == int(expected), (torch, self_connected, stores, jobs)
            if expected:
                (job,) = jobs
                assert job["id"] == f"127.0.0.1:{ports[0]}"
                assert job["found_by"] == "store connections" and job["master"] == job["id"]
                assert [r["rank"] for r in job["ranks"]] == [0, None, None], job["ranks"]
                assert job["ranks"][0]["rank_source"] == "store host"
                assert job["launcher"] == "bare" and job["world_size"] is None


# A stand-in for the ranks' own connections (gloo's pairs, NCCL's bootstrap ring), without
# torch.distributed: each process listens, connects to the ports given, and prints its own.
PEER_SHAPE = r"""
import select, socket, sys, threading
if sys.argv[1] == "torch":
    import torch  # noqa: F401
threading.Thread(target=threading.Event().wait, daemon=True).start()
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
held = [socket.create_connection(("127.0.0.1", int(port))) for port in sys.argv[2:]]
print(server.getsockname()[1], flush=True)
while True:
    held.append(server.accept()[0])
"""


@contextlib.contextmanager
def peer_shape(torch: bool, groups: list[int], tag: str = "") -> Iterator[list[list[int]]]:
    """Groups of processes, each connected to every earlier one of its group (tagged `tag`
    when given); yields each group's PIDs; kills the processes after."""
    env = dict(os.environ, CHAOSGPU_TAG=tag) if tag else None
    pids: list[list[int]] = []
    with shape_processes() as start:
        for size in groups:
            ports: list[str] = []
            pids.append([])
            for _ in range(size):
                pid, port = start(PEER_SHAPE, "torch" if torch else "plain", *ports, env=env)
                ports.append(port)
                pids[-1].append(pid)
        yield pids


@pytest.mark.slow
def test_processes_joined_by_their_own_connections_are_a_job_when_torchs() -> None:
    """No store, no environment (a file:// rendezvous): torch processes connected to one
    another within the node are a job found by "peer connections", named after the oldest,
    no rank numbered; two separate groups are two jobs; the same shape without torch is none."""
    for torch, groups in ((False, [3]), (True, [3, 2])):
        with peer_shape(torch, groups) as pids:
            mine = {pid for group in pids for pid in group}
            jobs = [j for j in node.take_census(gpu=False)["jobs"]
                    if {r["pid"] for r in j["ranks"]} & mine]
            if not torch:
                assert jobs == [], jobs
                continue
            assert sorted(sorted(r["pid"] for r in j["ranks"]) for j in jobs) == sorted(
                sorted(group) for group in pids), jobs
            for job in jobs:
                first = min(r["pid"] for r in job["ranks"])
                assert job["id"] == f"peers:{first}" and job["found_by"] == "peer connections"
                assert job["master"] is None and job["launcher"] == "bare"
                assert all(r["rank"] is None and r["state"] == "alive" for r in job["ranks"])


@pytest.mark.slow
def test_an_observer_keeps_judging_a_peer_job_whose_oldest_process_ended() -> None:
    """A job found by its peers' connections is named after its oldest process: when that one
    dies the census names the job after the next, and an observer keeps the job it saw (the
    same rank processes), the dead one's exit included."""
    tag = f"peers-{os.environ['CHAOSGPU_TEST_ID']}"
    with peer_shape(True, [3], tag=tag) as (pids,):
        observer = Observer(tag=tag, stacks=False, census_every_s=0.05)
        try:
            observer.tick()
            assert list(observer.tracks) == [f"peers:{pids[0]}"], observer.tracks
            os.kill(pids[0], signal.SIGKILL)
            wait_for(lambda: any(j["id"] == f"peers:{pids[1]}"
                                 for j in node.take_census(gpu=False)["jobs"]),
                     timeout=20, what="the job to be named after its next oldest process")
            time.sleep(0.1)
            observer.tick()
            assert list(observer.tracks) == [f"peers:{pids[0]}"], observer.tracks
            ranks = observer.tracks[f"peers:{pids[0]}"].ranks
            assert sorted(pid for pid, _ in ranks) == sorted(pids), ranks
        finally:
            observer.close()


# A bare torch.distributed rank: tcp:// rendezvous (rank 0 serves the store), one all_reduce,
# then idle with its connections open.
BARE_RANK = r"""
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2],
                        rank=int(sys.argv[1]), world_size=3)
dist.all_reduce(torch.ones(2))
print("ready", flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_the_ranks_left_when_the_store_host_dies_are_found_by_their_own_connections() -> None:
    """A 3-rank job found by its store; rank 0, the store's host, is killed: its store and the
    job's id go with it, and the two ranks left are found by their connections to each other."""
    port = str(_free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", BARE_RANK, str(rank), port],
                              stdout=subprocess.PIPE, text=True, env=dict(
                                  os.environ, OMP_NUM_THREADS="1")) for rank in range(3)]
    try:
        for rank in ranks:
            assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        pids = [rank.pid for rank in ranks]
        job = wait_for(lambda: next((j for j in node.take_census(gpu=False)["jobs"]
                                     if j["id"] == f"127.0.0.1:{port}"), None),
                       timeout=20, what="the job to be found by its store")
        assert [(r["rank"], r["pid"]) for r in job["ranks"]] == [
            (0, pids[0]), (None, pids[1]), (None, pids[2])], job["ranks"]
        ranks[0].kill()
        ranks[0].wait()
        found = wait_for(lambda: next((j for j in node.take_census(gpu=False)["jobs"]
                                       if j["found_by"] == "peer connections"
                                       and {r["pid"] for r in j["ranks"]} & set(pids)), None),
                         timeout=20, what="the ranks left to be found by their connections")
        assert found["id"] == f"peers:{pids[1]}", found
        assert [r["pid"] for r in found["ranks"]] == pids[1:], found["ranks"]
        assert not [j for j in node.take_census(gpu=False)["jobs"]
                    if j["id"] == f"127.0.0.1:{port}"]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


@pytest.mark.slow
def test_two_torchrun_jobs_without_a_run_id_are_two_jobs() -> None:
    """torchrun's default run id ("none", no `--rdzv-id`) names no job: two jobs started so are
    two jobs, named by their masters, each with its own launcher and two ranks."""
    with torchrun_job(None) as first, torchrun_job(None) as second:
        def both() -> list[dict] | None:
            jobs = [j for j in node.take_census(gpu=False)["jobs"]
                    if j["launcher_pid"] in (first.pid, second.pid)]
            ready = len(jobs) == 2 and all(len(j["ranks"]) == 2 and all(
                r["pid"] is not None for r in j["ranks"]) for j in jobs)
            return jobs if ready else None

        jobs = wait_for(both, timeout=120, what="both jobs' ranks to run")
        by_launcher = {j["launcher_pid"]: j for j in jobs}
        assert set(by_launcher) == {first.pid, second.pid}
        for launcher, job in by_launcher.items():
            assert job["id"] == job["master"] and job["id"].startswith("127.0.0.1:")
            assert sorted(r["rank"] for r in job["ranks"]) == [0, 1]
            census = {p["pid"]: p for p in node.take_census(gpu=False)["processes"]}
            assert all(census[r["pid"]]["ppid"] == launcher for r in job["ranks"])
            assert all(census[r["pid"]]["env"]["TORCHELASTIC_RUN_ID"] == "none"
                       for r in job["ranks"])
        assert by_launcher[first.pid]["id"] != by_launcher[second.pid]["id"]
        assert not [j for j in node.take_census(gpu=False)["jobs"] if j["id"] == "none"]
        started = [first.pid, second.pid] + [r["pid"] for j in jobs for r in j["ranks"]]
    assert wait_until(lambda: not [pid for pid in started if alive(pid)])


@pytest.mark.slow
def test_one_observer_judges_a_job_started_again_under_its_id_afresh() -> None:
    """A game-day's next round: the same `--rdzv-id` started again under one watch. The first
    run failed (a rank SIGKILLed); the second, with a new launcher, is running, with only its
    own ranks. Before round 21 the first run's verdict and ranks stayed."""
    run_id = f"rerun-{os.environ['CHAOSGPU_TEST_ID']}"
    observer = Observer(job=run_id, stacks=False, tick_s=0.2, census_every_s=0.2)

    def verdict_is(wanted: str) -> bool | None:
        observer.tick()
        track = observer.tracks.get(run_id)
        return (track is not None and track.verdict == wanted) or None

    try:
        with torchrun_job(run_id):
            first = wait_for(lambda: _running(run_id), timeout=120, what="the first run")
            os.kill(first["ranks"][1]["pid"], signal.SIGKILL)
            wait_for(lambda: verdict_is("failed"), timeout=60, what="the first run to fail")
        with torchrun_job(run_id) as launcher:
            second = wait_for(lambda: _running(run_id), timeout=120, what="the second run")
            wait_for(lambda: verdict_is("running"), timeout=60, what="the second run judged")
            track = observer.tracks[run_id]
            assert track.launcher is not None and track.launcher["pid"] == launcher.pid
            assert set(track.ranks) == {(r["pid"], r["starttime"]) for r in second["ranks"]}
    finally:
        observer.close()
