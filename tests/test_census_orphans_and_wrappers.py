"""What a fresh census (no memory of earlier ones) makes of a rank's processes once the process
above them died. Real processes, read by the real census (this process's, and the in-target
program run afresh).

* A DataLoader worker whose rank was SIGKILLed is orphaned and lives on (stuck in its dataset,
  it never notices). It carries the rank's RANK: before, a fresh census listed it as that
  rank, and a restarted rank beside it was a second rank of that number. torch names a
  worker's main thread `pt_data_worker` (/proc/PID/comm): such a process is a helper left
  behind, never a rank, with the reason in the job's `orphaned_helpers`, whoever adopted it
  (init, or a subreaper the census does not know). A real torch DataLoader, and a plain fork
  named so (the faster case).
* A wrapper (`bash -c "python train.py; true"`, whose shell forks the trainer and stays its
  parent) SIGKILLed: its trainer, adopted by init, is still its job's rank. Before, a trainer
  with forked copies of itself (DataLoader workers) was taken for a copy left behind (its
  copies share its argv and environment placement) and the job had no rank left; a wrapper's
  `sleep` sidecar became a second rank 0, or the only one; with torchrun's run id, the trainer
  outside a session of its own whose leader (the wrapper) was gone was dropped.

Every process a test starts carries a unique CHAOSGPU_TAG; at the end each one is SIGKILLed by
PID after its start time was checked (orphans are reparented away from the test), and its
/proc entry is proven gone.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from census_helpers import run_program, wait_for

from chaosgpu import node

#: A rank: a multi-threaded Python trainer (importing torch starts threads; a Python thread
#: stands in) that makes copies of itself: `dataloader N` (a torch DataLoader with N forked
#: workers stuck in their dataset), `fork N` (N plain forks), `named N` (N plain forks that name
#: themselves pt_data_worker, as torch's workers do). Prints "ready" once they are started.
TRAINER = r"""
import os, sys, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
mode, count = sys.argv[1], int(sys.argv[2])
if mode == "dataloader":
    import torch.utils.data

    class Stuck(torch.utils.data.Dataset):
        def __len__(self):
            return 1000

        def __getitem__(self, index):
            time.sleep(600)  # a worker stuck here never notices its rank's death
            return index

    loader = iter(torch.utils.data.DataLoader(Stuck(), num_workers=count))
else:
    for _ in range(count):
        if os.fork() == 0:
            if mode == "named":
                with open("/proc/self/comm", "w") as comm:
                    comm.write("pt_data_worker")
            time.sleep(600)
            os._exit(0)
print("ready", flush=True)
time.sleep(600)
"""

#: A subreaper the census does not know (a Python supervisor): runs its arguments and reaps.
ADOPTER = r"""
import ctypes, os, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
subprocess.Popen(sys.argv[1:])
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.05)
"""

RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "CHAOSGPU_JOB", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (index 0: state, 1: ppid)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _starttime(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def _ppid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            found += [int(p) for p in
                      Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return sorted(set(found))


def _tagged(tag: str) -> dict[int, int]:
    """{pid: start time} of the live processes whose environment carries CHAOSGPU_TAG=`tag`."""
    needle = f"CHAOSGPU_TAG={tag}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        start = _starttime(int(entry))
        if needle in environ.split(b"\0") and start is not None:
            found[int(entry)] = start
    return found


class Tagged:
    """The processes of one test: all carry CHAOSGPU_TAG=`tag`."""

    def __init__(self) -> None:
        self.tag = f"orphans-{uuid.uuid4().hex[:10]}"
        self.job = self.tag
        self.port = _free_port()
        self.started: list[subprocess.Popen[bytes]] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in RANK_KEYS}
        env.update(CHAOSGPU_TAG=self.tag, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONUNBUFFERED="1", TRAINER=TRAINER, PY=sys.executable)
        env.update(extra)
        return env

    def rank_env(self, **extra: str) -> dict[str, str]:
        """Rank 0's environment of a one-rank job named by CHAOSGPU_JOB."""
        return self.env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(self.port), CHAOSGPU_JOB=self.job, **extra)

    def start(self, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, start_new_session=True)
        self.started.append(proc)
        return proc

    def end(self) -> None:
        """SIGKILL every tagged process by PID (its start time checked first: orphans are not
        the test's children), reap the test's own, and prove every /proc entry gone."""
        seen: dict[int, int] = {}
        deadline = time.monotonic() + 60
        while True:
            living = _tagged(self.tag)
            if not living:
                break
            seen.update(living)
            for pid, start in living.items():
                if _starttime(pid) == start:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            assert time.monotonic() < deadline, f"tagged processes live on: {living}"
            time.sleep(0.05)
        for proc in self.started:
            proc.wait(timeout=60)
            if proc.stdout:
                proc.stdout.close()

        def gone() -> bool:
            for pid in seen:  # reaped by init or the adopter; by this process if its own
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            return not [pid for pid, start in seen.items() if _starttime(pid) == start]

        wait_for(gone, timeout=60, what=f"the /proc entries of {sorted(seen)} gone")


@pytest.fixture
def tagged() -> Iterator[Tagged]:
    processes = Tagged()
    try:
        yield processes
    finally:
        processes.end()


def _ready(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == b"ready", line


def _copies(pid: int, count: int, comm: str | None = None) -> list[int]:
    """The `count` children of `pid` (named `comm`, when given), once they are there."""
    def there() -> list[int]:
        kids = [k for k in _children(pid) if comm is None or _comm(k) == comm]
        return kids if len(kids) == count else []

    return wait_for(there, timeout=120, what=f"{count} children of {pid}") if count else []


def _kill(pid: int) -> None:
    """SIGKILL `pid` (a child of this test) and reap it."""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _reparented(pids: list[int], parent: int) -> None:
    wait_for(lambda: all(_ppid(pid) not in (parent, None) for pid in pids), timeout=30,
             what=f"{pids} reparented away from {parent}")


def _censuses() -> Iterator[tuple[str, dict[str, Any]]]:
    """A census by the in-target program run afresh (no memory of earlier censuses), and one
    by this process (which remembers what it saw)."""
    import json

    out = run_program("--no-gpu", "--no-fds", timeout=120)
    assert out.returncode == 0, out.stderr
    yield "fresh", json.loads(out.stdout)
    yield "this process's", node.take_census(gpu=False)


def _job(census: dict[str, Any], job_id: str) -> dict[str, Any]:
    found = [j for j in census["jobs"] if j["id"] == job_id]
    assert len(found) == 1, census["jobs"]
    return found[0]


def _rank_pids(job: dict[str, Any]) -> list[int]:
    return [r["pid"] for r in job["ranks"] if r["pid"] is not None]


def _orphaned(job: dict[str, Any]) -> dict[int, str]:
    return {h["pid"]: h["why"] for h in job.get("orphaned_helpers") or []}


# --- 1. a lone orphaned DataLoader worker ---------------------------------------------------

def test_a_dead_rank_s_lone_dataloader_worker_is_no_rank_beside_its_restart(
        tagged: Tagged) -> None:
    """A bare rank 0 with a real torch DataLoader (one worker, stuck in its dataset) is
    SIGKILLed: its worker, adopted by init, carries RANK=0 and lives on. No census lists it as
    rank 0; it is a helper left behind (`pt_data_worker`); rank 0 restarted beside it is the
    job's only rank 0, its own worker its helper."""
    pytest.importorskip("torch")
    rank = tagged.start([sys.executable, "-c", TRAINER, "dataloader", "1"], tagged.rank_env())
    _ready(rank)
    [worker] = _copies(rank.pid, 1, "pt_data_worker")
    for _, census in _censuses():
        job = _job(census, tagged.job)
        assert _rank_pids(job) == [rank.pid] and job["ranks"][0]["helpers"] == [worker]
    _kill(rank.pid)
    _reparented([worker], rank.pid)
    for which, census in _censuses():
        job = _job(census, tagged.job)
        assert _rank_pids(job) == [], (which, job)
        assert _orphaned(job) == {worker: "pt_data_worker"}, (which, job)
        assert [(r["rank"], r["state"]) for r in job["ranks"]] == [(0, "missing")], which
    restarted = tagged.start([sys.executable, "-c", TRAINER, "dataloader", "1"],
                             tagged.rank_env())
    _ready(restarted)
    [own] = _copies(restarted.pid, 1, "pt_data_worker")
    assert _starttime(worker) is not None  # the dead rank's worker lives on beside it
    for which, census in _censuses():
        job = _job(census, tagged.job)
        assert _rank_pids(job) == [restarted.pid], (which, job)
        assert job["ranks"][0]["rank"] == 0 and job["ranks"][0]["helpers"] == [own], which
        assert _orphaned(job) == {worker: "pt_data_worker"}, (which, job)


@pytest.mark.parametrize("adopter", ["init", "unknown subreaper"])
def test_a_dead_rank_s_lone_fork_named_pt_data_worker_is_no_rank(
        tagged: Tagged, adopter: str) -> None:
    """The same with a plain fork that names itself pt_data_worker, adopted by init or by a
    subreaper the census does not know (a Python supervisor: the orphan rules for adopted
    processes never looked at it)."""
    command = ["env", *(f"{k}={v}" for k, v in tagged.rank_env().items() if k in RANK_KEYS),
               sys.executable, "-c", TRAINER, "named", "1"]
    if adopter == "init":
        rank = tagged.start(command, tagged.rank_env())
        _ready(rank)
        rank_pid = rank.pid
    else:
        supervisor = tagged.start([sys.executable, "-c", ADOPTER, *command], tagged.env())
        _ready(supervisor)  # the rank writes to the pipe it inherited
        [rank_pid] = _copies(supervisor.pid, 1)
    [worker] = _copies(rank_pid, 1, "pt_data_worker")
    for _, census in _censuses():
        assert _rank_pids(_job(census, tagged.job)) == [rank_pid]
    if adopter == "init":
        _kill(rank_pid)
    else:
        os.kill(rank_pid, signal.SIGKILL)  # the supervisor reaps it
    _reparented([worker], rank_pid)
    for which, census in _censuses():
        job = _job(census, tagged.job)
        assert _rank_pids(job) == [], (which, job)
        assert _orphaned(job) == {worker: "pt_data_worker"}, (which, job)


# --- 2. a trainer whose wrapper died --------------------------------------------------------

def _wrapped(tagged: Tagged, script: str, env: dict[str, str],
             copies: int, sidecar: bool) -> tuple[int, int, list[int], list[int]]:
    """`bash -c script` (forking the trainer, staying its parent) with rank 0's environment;
    returns (wrapper, trainer, the trainer's copies, the sidecars)."""
    wrapper = tagged.start(["bash", "-c", script], env)
    _ready(wrapper)
    kids = _copies(wrapper.pid, 2 if sidecar else 1)
    [trainer] = [k for k in kids if _comm(k) != "sleep"]
    sidecars = [k for k in kids if k != trainer]
    return wrapper.pid, trainer, _copies(trainer, copies), sidecars


@pytest.mark.parametrize("copies", ["dataloader", "fork"])
def test_a_trainer_with_copies_stays_the_rank_when_its_wrapper_dies(
        tagged: Tagged, copies: str) -> None:
    """`bash -c '"$PY" -c "$TRAINER" ... 2; true'`: the trainer has 2 copies of itself (a
    torch DataLoader's workers, or plain forks). SIGKILL the shell: the trainer, adopted by
    init, is still rank 0 and its copies its helpers. Before, its own copies, sharing its argv
    and environment placement, made it "a forked copy left behind": the job had no rank."""
    if copies == "dataloader":
        pytest.importorskip("torch")
    script = f'"$PY" -c "$TRAINER" {copies} 2; true'
    wrapper, trainer, workers, _ = _wrapped(tagged, script, tagged.rank_env(), 2, False)
    for _, census in _censuses():
        job = _job(census, tagged.job)
        assert _rank_pids(job) == [trainer] and job["ranks"][0]["helpers"] == workers
    _kill(wrapper)
    _reparented([trainer], wrapper)
    for which, census in _censuses():
        job = _job(census, tagged.job)
        assert _rank_pids(job) == [trainer], (which, job)
        assert job["ranks"][0]["rank"] == 0 and job["ranks"][0]["state"] == "alive"
        assert job["ranks"][0]["helpers"] == workers, (which, job)
        assert _orphaned(job) == {}, (which, job)


@pytest.mark.parametrize("copies", [0, 2])
def test_a_trainer_and_its_sidecar_left_by_a_dead_wrapper(tagged: Tagged, copies: int) -> None:
    """A per-rank script that starts a `sleep` sidecar, then the trainer (with 0 or 2 forked
    copies). SIGKILL the script: both are adopted by init; the trainer is still the only rank
    0, the sidecar its helper. Before, a fresh census listed the sidecar as a second rank 0
    (no copies), or as the only rank 0 while the trainer was dropped (copies)."""
    script = f'sleep 600 & "$PY" -c "$TRAINER" fork {copies}; true'
    wrapper, trainer, workers, [sleep] = _wrapped(tagged, script, tagged.rank_env(), copies,
                                                  True)
    for _, census in _censuses():
        job = _job(census, tagged.job)
        assert _rank_pids(job) == [trainer]
        assert sorted(job["ranks"][0]["helpers"]) == sorted([sleep, *workers])
    _kill(wrapper)
    _reparented([trainer, sleep], wrapper)
    for which, census in _censuses():
        job = _job(census, tagged.job)
        assert _rank_pids(job) == [trainer], (which, job)
        assert sorted(job["ranks"][0]["helpers"]) == sorted([sleep, *workers]), (which, job)


@pytest.mark.parametrize("shape", ["sidecar", "copies"])
def test_torchrun_s_trainer_stays_the_rank_when_its_session_leading_wrapper_dies(
        tagged: Tagged, shape: str) -> None:
    """With torchrun's run id, the per-rank wrapper leads the session (torchrun starts each
    rank so) and the trainer lives in it. SIGKILL the wrapper: the trainer, in a session whose
    leader is gone, is still the rank (a sidecar beside it, or 2 forked copies below it, tell
    it from a DataLoader worker left behind). Before, it was dropped: the job had no rank."""
    run_id = f"run-{tagged.tag}"
    env = tagged.rank_env(TORCHELASTIC_RUN_ID=run_id)
    if shape == "sidecar":
        script = 'sleep 600 & "$PY" -c "$TRAINER" fork 0; true'
    else:
        script = '"$PY" -c "$TRAINER" fork 2; true'
    wrapper, trainer, workers, sidecars = _wrapped(tagged, script, env,
                                                   2 if shape == "copies" else 0,
                                                   shape == "sidecar")
    assert os.getsid(trainer) == wrapper
    for _, census in _censuses():
        assert _rank_pids(_job(census, run_id)) == [trainer]
    _kill(wrapper)
    _reparented([trainer], wrapper)
    for which, census in _censuses():
        job = _job(census, run_id)
        assert _rank_pids(job) == [trainer], (which, job)
        assert sorted(job["ranks"][0]["helpers"]) == sorted(sidecars + workers), (which, job)
