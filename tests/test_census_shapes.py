"""Launch shapes the census met in the field and misread, each started for real (torchrun and
torch.multiprocessing.spawn jobs on gloo, tests/jobs/): the census must name the trainers as
the ranks, and the rank faults (freeze_rank, kill_rank, cleanup_hung_job) must hit them and
nothing else.

* torchrun run by another program that names it in its arguments (`sh -c "... torchrun ..."`,
  `timeout`, and beside it `tail -f torchrun.log`): only torchrun itself is the launcher.
* a per-rank wrapper script (`torchrun --no-python bash wrap_sidecar.sh ...`) that starts a
  sidecar, then the trainer: the trainer is the rank, the sidecar its helper.
* a killed rank's DataLoader workers, orphaned: helpers left behind, never "that rank".
* a spawn job (file:// rendezvous, MASTER_PORT exported) whose main process starts an
  evaluator after its ranks: the evaluator is no rank.
* a trainer that supervises itself (re-runs its command line, or runs training in a
  spawn-context child): the child that trains is the rank, not the idle supervisor or
  multiprocessing's resource tracker.
"""

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

from census_helpers import PROGRAM  # noqa: E402
from jobs.launch import TRAIN, Job, free_port, start_torchrun  # noqa: E402
from proc_helpers import alive, tagged, wait_until  # noqa: E402

from chaosgpu.job import actions  # noqa: E402
from chaosgpu.job.observe import JobError  # noqa: E402
from chaosgpu.node import take_census  # noqa: E402

pytestmark = pytest.mark.slow

JOBS = Path(__file__).resolve().parent / "jobs"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                out.extend(int(p) for p in handle.read().split())
    except OSError:
        pass
    return sorted(set(out))


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return [a.decode() for a in handle.read().split(b"\0") if a]
    except OSError:
        return []


def jobs_tagged(tag: str, census: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    census = census or take_census(gpu=False)
    return [j for j in census["jobs"] if j["tag"] == tag]


def stopped_everything(job: Job) -> None:
    """Stop the job and prove nothing carrying its tag lives on."""
    job.stop()
    assert wait_until(lambda: not tagged(job.tag, live_only=True), timeout_s=30), \
        tagged(job.tag, live_only=True)


def fresh_census() -> dict[str, Any]:
    """A census taken by a new process (the in-target program): no memory of earlier ones."""
    import json

    out = subprocess.run([sys.executable, str(PROGRAM), "--no-gpu", "--no-fds"],
                         capture_output=True, check=True, timeout=60)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


# --- torchrun named in another program's arguments ------------------------------------------

def test_only_torchrun_itself_is_the_launcher_not_a_shell_timeout_or_tail_naming_it(
        tmp_path: Path) -> None:
    """`sh -c "timeout 600 torchrun ..."` beside `tail -f torchrun.log`: one job, whose launcher
    is the torchrun agent; cleanup_hung_job ends the agent and its ranks and sends nothing to
    the shell, `timeout` or `tail`. Before round 22 the shell, `timeout` and `tail` were each
    taken for a torchrun (their first arguments mention it): phantom jobs broke every tag
    selection and the cleanup signalled the wrong process."""
    if not TORCHRUN.exists():
        pytest.skip(f"torchrun is not installed beside {sys.executable}")
    tag = f"shapes-{uuid.uuid4().hex[:8]}"
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    job = Job(run_id, tag, tmp_path)
    job.progress_dir.mkdir()
    env = dict(os.environ, CHAOSGPU_TAG=tag, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_RUN_ID", None)
    log = tmp_path / "torchrun.log"
    log.write_bytes(b"")
    command = (f"cd {tmp_path} && timeout 600 {TORCHRUN} --nproc-per-node=2 "
               f"--monitor-interval=0.1 --rdzv-backend=c10d "
               f"--rdzv-endpoint=127.0.0.1:{free_port()} --rdzv-id={run_id} {TRAIN} "
               f"--progress-dir {job.progress_dir} >> {log} 2>&1; exit 7")
    shell = subprocess.Popen(["sh", "-c", command], env=env, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    tail = subprocess.Popen(["tail", "-f", str(log)], env=env, stdout=subprocess.DEVNULL,
                            start_new_session=True)
    job.processes += [shell, tail]
    try:
        trainers = {rank: p["pid"] for rank, p in job.wait_steps(3).items()}
        timeout_pid = children(shell.pid)[0]
        agent = children(timeout_pid)[0]
        assert cmdline(agent)[1] == str(TORCHRUN)
        found = jobs_tagged(tag)
        assert [j["id"] for j in found] == [run_id], found
        assert found[0]["launcher_pid"] == agent
        assert [(r["rank"], r["pid"]) for r in found[0]["ranks"]] == sorted(trainers.items())
        done = actions.cleanup_hung_job(job=run_id, grace_s=5)
        assert sorted(done["removed"]) == sorted([agent, *trainers.values()]), done
        assert shell.wait(timeout=30) == 7  # torchrun ended; no signal reached the shell
        assert tail.poll() is None  # `tail -f torchrun.log` was left alone
        assert not alive(timeout_pid)  # it exited with torchrun, no signal of ours
    finally:
        stopped_everything(job)


# --- a per-rank wrapper script that starts a sidecar ----------------------------------------

def test_a_wrapper_scripts_sidecar_is_a_helper_and_the_trainer_takes_the_faults(
        tmp_path: Path) -> None:
    """`torchrun --no-python bash wrap_sidecar.sh python train.py`: each wrapper runs a `sleep`
    sidecar, then the trainer. The census lists the trainers as ranks 0 and 1, each with its
    sidecar as helper; freeze_rank(0) stops trainer 0 and kill_rank(1) kills trainer 1, and
    neither touches a sidecar. Before round 22 each sidecar was a second rank of the same
    number, and both faults hit the sidecars."""
    job = start_torchrun(tmp_path, [], launcher_args=[
        "--no-python", "bash", str(JOBS / "wrap_sidecar.sh"), sys.executable])
    try:
        trainers = {rank: p["pid"] for rank, p in job.wait_steps(3).items()}
        wrappers = {rank: next(p for p in children(job.processes[0].pid)
                               if pid in children(p)) for rank, pid in trainers.items()}
        sidecars = {rank: [p for p in children(w) if p != trainers[rank]]
                    for rank, w in wrappers.items()}
        assert all(len(s) == 1 and cmdline(s[0])[0] == "sleep" for s in sidecars.values())
        for census in (take_census(gpu=False), fresh_census()):
            found = jobs_tagged(job.tag, census)
            assert len(found) == 1, found
            assert [(r["rank"], r["pid"]) for r in found[0]["ranks"]] == sorted(
                trainers.items()), found
            for entry in found[0]["ranks"]:
                assert entry["helpers"] == sidecars[entry["rank"]]
        frozen = actions.freeze_rank(0, job=job.run_id)
        assert frozen["pid"] == trainers[0]
        with open(f"/proc/{sidecars[0][0]}/stat") as handle:
            assert handle.read().rsplit(")", 1)[1].split()[0] == "S"  # the sidecar runs on
        # (when trainer 1 dies its wrapper ends its sidecar: that is the wrapper's doing)
        killed = actions.kill_rank(1, job=job.run_id, wait_s=5)
        assert killed["pid"] == trainers[1]
    finally:
        stopped_everything(job)


# --- a killed rank's orphaned DataLoader workers --------------------------------------------

def test_a_killed_ranks_orphaned_dataloader_workers_never_become_that_rank(
        tmp_path: Path) -> None:
    """kill_rank(0) on a torchrun job whose ranks read from 2 forked DataLoader workers each:
    the workers of the dead rank live on for seconds, adopted by init, with RANK=0. No census
    (this process's, or a fresh one's) lists them as ranks, and the next freeze_rank(0) finds
    no rank 0 rather than stopping a worker. Before round 22 each worker was "rank 0"
    (rank_source env), and freeze_rank(0) stopped one."""
    job = start_torchrun(tmp_path, ["--loader-workers", "2"], max_restarts=1)
    try:
        trainers = {rank: p["pid"] for rank, p in job.wait_steps(3).items()}
        found = jobs_tagged(job.tag)[0]
        workers = set(next(r for r in found["ranks"] if r["rank"] == 0)["helpers"])
        assert len(workers) == 2 and workers <= set(children(trainers[0]))
        assert actions.kill_rank(0, job=job.run_id, wait_s=5)["pid"] == trainers[0]
        seen_orphans = 0
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            for census in (take_census(gpu=False), fresh_census()):
                living = {p["pid"] for p in census["processes"] if p["pid"] in workers
                          and not p["zombie"]}
                seen_orphans += bool(living)
                ranks = {r["pid"] for j in census["jobs"] for r in j["ranks"]}
                assert not ranks & workers, census["jobs"]
            try:
                frozen = actions.freeze_rank(0, job=job.run_id)
            except JobError:
                continue
            assert frozen["pid"] not in workers, frozen
            os.kill(frozen["pid"], signal.SIGCONT)
        assert seen_orphans, "the workers were gone before any census: nothing was tested"
    finally:
        stopped_everything(job)


# --- a spawn job's later child --------------------------------------------------------------

def test_a_spawn_jobs_evaluator_started_after_its_ranks_is_no_rank(tmp_path: Path) -> None:
    """tests/jobs/spawn_evaluator.py: 2 spawn ranks joined by gloo over a file:// rendezvous,
    MASTER_PORT exported, and an evaluator started 3 s later by the main process. The census
    lists the 2 ranks only, and freeze_rank("any") picks one of them. Before round 22 the
    evaluator was a third rank and freeze_rank("any") froze it."""
    tag = f"shapes-{uuid.uuid4().hex[:8]}"
    job = Job("", tag, tmp_path)
    env = dict(os.environ, CHAOSGPU_TAG=tag, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    with open(tmp_path / "spawn.log", "wb") as log:
        job.processes.append(subprocess.Popen(
            [sys.executable, str(JOBS / "spawn_evaluator.py"), str(free_port()),
             str(tmp_path / "store")], env=env, stdout=log, stderr=log,
            stdin=subprocess.DEVNULL, start_new_session=True))
    try:
        def started() -> tuple[dict[int, int], int] | None:
            ranks, evaluator = {}, None
            for line in (tmp_path / "spawn.log").read_text(errors="replace").splitlines():
                parts = line.split()
                if parts[:1] == ["rank"] and len(parts) == 6 and int(parts[5]) >= 3:
                    ranks[int(parts[1])] = int(parts[3])
                if parts[:2] == ["evaluator", "pid"]:
                    evaluator = int(parts[2])
            return (ranks, evaluator) if len(ranks) == 2 and evaluator else None

        assert wait_until(lambda: started() is not None, timeout_s=120), job.logs()
        ranks, evaluator = started() or ({}, 0)
        def torch_loaded() -> bool:
            try:
                return "/libtorch" in Path(f"/proc/{evaluator}/maps").read_text()
            except OSError:
                return False

        assert wait_until(torch_loaded, timeout_s=60)  # the evaluator has imported torch
        for census in (take_census(gpu=False), fresh_census()):
            found = jobs_tagged(tag, census)
            assert len(found) == 1, found
            assert sorted(r["pid"] for r in found[0]["ranks"]) == sorted(ranks.values()), found
        frozen = actions.freeze_rank("any", tag=tag)
        assert frozen["pid"] in ranks.values() and frozen["pid"] != evaluator
    finally:
        stopped_everything(job)


# --- self-supervising trainers --------------------------------------------------------------

@pytest.mark.parametrize("mode", ["rerun", "spawn"])
def test_a_self_supervising_trainers_child_is_the_rank(tmp_path: Path, mode: str) -> None:
    """tests/jobs/self_supervised.py under torchrun: the process torchrun starts (no torch)
    runs the training in a child, its own command line again (`rerun`) or a spawn-context
    multiprocessing child (`spawn`, beside multiprocessing's resource tracker). The census
    lists the training children as the ranks; freeze_rank(1) stops rank 1's trainer and
    cleanup_hung_job removes the trainers. Before round 22 the idle supervisor (or the
    resource tracker) was the rank, the fault hit it, and the cleanup left the trainers
    running."""
    job = start_torchrun(tmp_path, [], launcher_args=[
        str(JOBS / "self_supervised.py"), "--mode", mode])
    try:
        trainers = {rank: p["pid"] for rank, p in job.wait_steps(3).items()}
        supervisors = {rank: next(p for p in children(job.processes[0].pid)
                                  if pid in children(p)) for rank, pid in trainers.items()}

        def listed() -> list[tuple[int, int]]:
            found = jobs_tagged(job.tag)
            return [(r["rank"], r["pid"]) for r in found[0]["ranks"]] if found else []

        assert wait_until(lambda: listed() == sorted(trainers.items()), timeout_s=30), listed()
        frozen = actions.freeze_rank(1, job=job.run_id)
        assert frozen["pid"] == trainers[1]
        done = actions.cleanup_hung_job(job=job.run_id, grace_s=5)
        assert set(trainers.values()) <= set(done["removed"]), done
        assert wait_until(lambda: not any(alive(p) for p in trainers.values()), timeout_s=30)
        assert not set(supervisors.values()) & set(done["removed"]) - {job.processes[0].pid}
    finally:
        stopped_everything(job)
