"""Job shapes chaosgpu did not launch and the first release missed: a DistributedDataParallel
job started the way PyTorch's DDP tutorial starts it (torch.multiprocessing.spawn: ranks get
their rank as an argument, no RANK in any environment; tests/jobs/spawn_ddp.py), a PyTorch
Lightning DDP job (Lightning's launcher: the main process is rank 0 with nothing visible in its
environment, the other ranks carry LOCAL_RANK and NODE_RANK; tests/jobs/lightning_ddp.py) and
torchrun ranks that read their batches from DataLoader worker processes (which inherit the
rank's environment, RANK included). The census must find the ranks and only the ranks, the
faults must hit the trainer processes, and the verdicts must hold."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from conftest import require_tool  # noqa: E402
from jobs.launch import (  # noqa: E402
    Job,
    spawn_steps,
    start_lightning,
    start_mpirun,
    start_spawn,
    start_torchrun,
    wait_spawn_steps,
)
from proc_helpers import proc_state, wait_until  # noqa: E402
from test_catalog import REPO, outputs, run_experiment  # noqa: E402

from chaosgpu.job import actions, probes  # noqa: E402
from chaosgpu.node import census_module, take_census  # noqa: E402
from chaosgpu.process import actions as process_actions  # noqa: E402

pytestmark = pytest.mark.slow


def census_job(job_id: str = "", tag: str = "") -> dict[str, Any]:
    found = [j for j in take_census(gpu=False)["jobs"]
             if (job_id and j["id"] == job_id) or (tag and j["tag"] == tag)]
    assert len(found) == 1, found
    return found[0]


def children(pid: int) -> set[int]:
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            out.update(int(p) for p in handle.read().split())
    return out


def test_dataloader_workers_are_helpers_of_their_rank_not_ranks(tmp_path: Path,
                                                                 jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, ["--loader-workers", "2"])
    jobs.append(job)
    trainers = {rank: p["pid"] for rank, p in job.wait_steps(3).items()}
    found = census_job(job.run_id)
    assert [(r["rank"], r["pid"]) for r in found["ranks"]] == sorted(trainers.items()), found
    for entry in found["ranks"]:
        assert entry["rank_source"] == "env"
        assert len(entry["helpers"]) == 2 and set(entry["helpers"]) <= children(entry["pid"])
    killed = actions.kill_rank(job=job.run_id, rank=0, wait_s=5)
    assert killed["pid"] == trainers[0]  # the trainer, not one of its DataLoader workers


#: Where a spawn job's store address is given, and how the census then finds the job: the main
#: process's environment (inherited by the ranks), or, as PyTorch's DDP tutorial does it, each
#: rank's os.environ (invisible in /proc/PID/environ), or a tcp:// init_method (no variable):
#: then only the ranks' connections to their store name the job.
RENDEZVOUS = [("parent-env", "environment"), ("rank-env", "store connections"),
              ("tcp", "store connections")]


@pytest.mark.parametrize(("rendezvous", "found_by"), RENDEZVOUS)
def test_a_spawn_job_is_found_with_its_store_host_as_rank_0(tmp_path: Path, jobs: list[Job],
                                                            rendezvous: str,
                                                            found_by: str) -> None:
    job = start_spawn(tmp_path, rendezvous=rendezvous)
    jobs.append(job)
    wait_spawn_steps(job, 3)
    found = census_job(job.run_id)
    assert found["found_by"] == found_by
    assert found["master"] == job.run_id
    assert found["launcher"] == "multiprocessing"
    assert found["launcher_pid"] == job.processes[0].pid and found["max_restarts"] == 0
    assert found["tag"] == job.tag
    ranks = found["ranks"]
    assert len(ranks) == 2, ranks
    assert [(r["rank"], r["rank_source"]) for r in ranks] == [(0, "store host"), (None, None)]
    assert all(len(r["helpers"]) == 2 for r in ranks), ranks
    assert {r["pid"] for r in ranks} == children(job.processes[0].pid) - {
        p for r in ranks for p in r["helpers"]} - _resource_trackers(job.processes[0].pid)
    state = probes.job_state(job=job.run_id)
    assert state["verdict"] == "running", state["reason"]


def _resource_trackers(pid: int) -> set[int]:
    found = set()
    for child in children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as handle:
            if b"resource_tracker" in handle.read():
                found.add(child)
    return found


@pytest.mark.parametrize("rendezvous", [r for r, _ in RENDEZVOUS])
def test_a_frozen_spawn_rank_hangs_the_job_and_is_named_the_culprit(tmp_path: Path,
                                                                   jobs: list[Job],
                                                                   rendezvous: str) -> None:
    job = start_spawn(tmp_path, rendezvous=rendezvous)
    jobs.append(job)
    wait_spawn_steps(job, 3)
    unnumbered = next(r for r in census_job(job.run_id)["ranks"] if r["rank"] is None)
    frozen = process_actions.freeze_processes(scope={"pids": [unnumbered["pid"]]})
    assert frozen["sent"] == 1, frozen
    found = probes.detect_hang(job=job.run_id, timeout_s=30)
    assert found["verdict"] == "hung", found["reason"]
    assert [c["pid"] for c in found["culprit_ranks"]] == [unnumbered["pid"]], found
    assert f"rank ? (PID {unnumbered['pid']})" in found["reason"]
    assert found["blocked_in"]["ranks"] == [0], found["blocked_in"]
    assert process_actions.resume_processes(scope={"pids": [unnumbered["pid"]]})["sent"] == 1


@pytest.mark.parametrize("rendezvous", [r for r, _ in RENDEZVOUS])
def test_a_killed_spawn_rank_fails_the_job(tmp_path: Path, jobs: list[Job],
                                           rendezvous: str) -> None:
    job = start_spawn(tmp_path, rendezvous=rendezvous)
    jobs.append(job)
    wait_spawn_steps(job, 3)
    started = time.monotonic()
    actions.kill_rank(job=job.run_id, rank=0, wait_s=0)
    found = probes.detect_hang(job=job.run_id, timeout_s=20)
    assert time.monotonic() - started < 10.0
    assert found["verdict"] == "failed", found["reason"]
    ranks = found["ranks"]
    assert ranks[0]["rank"] == 0 and ranks[0]["exit"]["signal"] == "SIGKILL"
    assert ranks[1]["rank"] is None and ranks[1]["exit"] is not None  # ended by mp.spawn
    assert job.wait_exit(30)[0] not in (None, 0)  # the main process raised


def test_a_file_rendezvous_job_is_found_by_its_ranks_connections(tmp_path: Path,
                                                                  jobs: list[Job]) -> None:
    """init_method="file://...": no store and no variable name the job; the ranks' own
    connections (gloo's pairs) do. No rank shows its number. A frozen rank hangs the job and is
    named by PID; a killed one fails it, and the survivors' exits (mp.spawn ends them) are
    listed by PID."""
    job = start_spawn(tmp_path, world_size=3, rendezvous="file")
    jobs.append(job)
    wait_spawn_steps(job, 3)
    found = census_job(tag=job.tag)
    main = job.processes[0].pid
    ranks = found["ranks"]
    trainers = children(main) - {p for r in ranks for p in r["helpers"]} \
        - _resource_trackers(main)
    assert {r["pid"] for r in ranks} == trainers and len(trainers) == 3, found
    assert found["found_by"] == "peer connections" and found["master"] is None
    assert found["id"] in {f"peers:{pid}" for pid in trainers}, found["id"]
    assert [(r["rank"], r["rank_source"]) for r in ranks] == [(None, None)] * 3
    assert found["launcher"] == "multiprocessing" and found["launcher_pid"] == main
    assert all(len(r["helpers"]) == 2 for r in ranks), ranks
    state = probes.job_state(tag=job.tag)
    assert state["verdict"] == "running", state["reason"]
    victim = ranks[1]["pid"]
    assert process_actions.freeze_processes(scope={"pids": [victim]})["sent"] == 1
    hung = probes.detect_hang(tag=job.tag, timeout_s=30)
    assert hung["verdict"] == "hung", hung["reason"]
    assert [c["pid"] for c in hung["culprit_ranks"]] == [victim], hung
    assert f"rank ? (PID {victim})" in hung["reason"]
    assert process_actions.resume_processes(scope={"pids": [victim]})["sent"] == 1
    with ThreadPoolExecutor(1) as pool:  # the wait begins while all three run
        waiting = pool.submit(probes.wait_survivors_exit, tag=job.tag, timeout_s=30)
        time.sleep(2.0)
        killed = process_actions.signal_processes(scope={"pids": [victim]}, signal="SIGKILL")
        assert killed["sent"] == 1, killed
        waited = waiting.result(timeout=60)
    assert waited["all_exited"] is True and waited["verdict"] == "failed", waited
    assert waited["survivors"] == [None] * 3, waited
    assert set(waited["exits"]) == {f"? (PID {r['pid']})" for r in ranks}, waited["exits"]
    assert job.wait_exit(30)[0] not in (None, 0)  # the main process raised


def _mpirun_job(tmp_path: Path, jobs: list[Job]) -> tuple[Job, dict[int, int]]:
    require_tool("mpirun", install="apt-get install openmpi-bin")
    job = start_mpirun(tmp_path, [])
    jobs.append(job)
    trainers = {rank: p["pid"] for rank, p in job.wait_steps(3).items()}
    return job, trainers


def test_an_mpirun_job_is_found_by_its_launchers_task_numbers(tmp_path: Path,
                                                               jobs: list[Job]) -> None:
    """Ranks started by Open MPI's mpirun that set RANK inside Python show only
    OMPI_COMM_WORLD_* outside: they are the job's ranks, numbered from those, mpirun their
    launcher (which never restarts them), and the job runs."""
    job, trainers = _mpirun_job(tmp_path, jobs)
    found = census_job(job.run_id)
    assert [(r["rank"], r["pid"], r["local_rank"]) for r in found["ranks"]] == [
        (0, trainers[0], 0), (1, trainers[1], 1)], found
    assert {r["rank_source"] for r in found["ranks"]} == {"OMPI_COMM_WORLD_RANK"}
    assert found["world_size"] == 2 and found["expected_ranks"] == [0, 1]
    assert found["launcher"] == "mpirun" and found["launcher_pid"] == job.processes[0].pid
    assert found["max_restarts"] == 0 and found["tag"] == job.tag
    state = probes.job_state(job=job.run_id)
    assert state["verdict"] == "running", state["reason"]


def test_an_mpirun_job_that_sets_its_master_inside_python_is_found_by_its_store(
        tmp_path: Path, jobs: list[Job]) -> None:
    """mpirun ranks that set MASTER_ADDR/MASTER_PORT themselves (nothing exported) show no
    job key outside: the job is found by its store's connections, its ranks still numbered
    from the launcher's variables, mpirun their launcher."""
    require_tool("mpirun", install="apt-get install openmpi-bin")
    job = start_mpirun(tmp_path, [], export_master=False)
    jobs.append(job)
    trainers = {rank: p["pid"] for rank, p in job.wait_steps(3).items()}
    found = census_job(job.run_id)
    assert found["found_by"] == "store connections" and found["master"] == job.run_id
    assert [(r["rank"], r["pid"], r["rank_source"]) for r in found["ranks"]] == [
        (0, trainers[0], "OMPI_COMM_WORLD_RANK"), (1, trainers[1], "OMPI_COMM_WORLD_RANK")]
    assert found["world_size"] == 2 and found["expected_ranks"] == [0, 1]
    assert found["launcher"] == "mpirun" and found["launcher_pid"] == job.processes[0].pid
    state = probes.job_state(job=job.run_id)
    assert state["verdict"] == "running", state["reason"]


def test_a_frozen_mpirun_rank_hangs_the_job_and_a_killed_one_fails_it(
        tmp_path: Path, jobs: list[Job]) -> None:
    """Faults by rank number reach an mpirun job's trainers; the verdicts hold: a frozen rank
    hangs its peer in all_reduce (the culprit named), a killed rank fails the job."""
    job, trainers = _mpirun_job(tmp_path, jobs)
    frozen = actions.freeze_rank(job=job.run_id, rank=1)
    assert frozen["pid"] == trainers[1], frozen
    found = probes.detect_hang(job=job.run_id, timeout_s=30)
    assert found["verdict"] == "hung", found["reason"]
    assert [c["rank"] for c in found["culprit_ranks"]] == [1], found["culprit_ranks"]
    assert found["blocked_in"]["ranks"] == [0] and found["blocked_in"]["what"] == "all_reduce"
    actions.resume_rank(job=job.run_id, rank=1)
    killed = actions.kill_rank(job=job.run_id, rank=0, wait_s=5)
    assert killed["pid"] == trainers[0], killed
    ended = probes.detect_hang(job=job.run_id, timeout_s=30)
    assert ended["verdict"] == "failed", ended["reason"]
    assert ended["ranks"][0]["exit"]["signal"] == "SIGKILL", ended["ranks"]
    assert job.wait_exit(30)[0] not in (None, 0)  # mpirun reports the lost rank


def test_an_mpich_hydra_job_is_found_by_its_pmi_numbers_and_a_killed_rank_fails_it(
        tmp_path: Path, jobs: list[Job]) -> None:
    """Ranks started by MPICH's Hydra (`mpiexec.hydra`, whose `hydra_pmi_proxy` starts them)
    that set RANK inside Python show only PMI_RANK/PMI_SIZE/MPI_LOCALRANKID outside: they are
    the job's ranks, numbered from those, the proxy their launcher; the job runs, a kill by
    rank number reaches the trainer and the job fails."""
    require_tool("mpiexec.hydra", install="apt-get install mpich")
    job = start_mpirun(tmp_path, [], flavour="mpich")
    jobs.append(job)
    trainers = {rank: p["pid"] for rank, p in job.wait_steps(3).items()}
    found = census_job(job.run_id)
    assert [(r["rank"], r["pid"], r["local_rank"]) for r in found["ranks"]] == [
        (0, trainers[0], 0), (1, trainers[1], 1)], found
    assert {r["rank_source"] for r in found["ranks"]} == {"PMI_RANK"}
    assert found["world_size"] == 2 and found["expected_ranks"] == [0, 1]
    proxy = census_module().read_stat(trainers[0])["ppid"]
    assert found["launcher"] == "hydra_pmi_proxy" and found["launcher_pid"] == proxy, found
    assert found["max_restarts"] == 0 and found["tag"] == job.tag
    state = probes.job_state(job=job.run_id)
    assert state["verdict"] == "running", state["reason"]
    killed = actions.kill_rank(job=job.run_id, rank=1, wait_s=5)
    assert killed["pid"] == trainers[1], killed
    ended = probes.detect_hang(job=job.run_id, timeout_s=30)
    assert ended["verdict"] == "failed", ended["reason"]
    assert ended["ranks"][1]["exit"]["signal"] == "SIGKILL", ended["ranks"]
    assert job.wait_exit(30)[0] not in (None, 0)  # Hydra reports the lost rank


def _record(pid: int, ppid: int, cmdline: list[str], env: dict[str, str]) -> dict[str, Any]:
    return {"pid": pid, "ppid": ppid, "cmdline": cmdline, "comm": cmdline[0].rsplit("/")[-1][:15],
            "env": env, "state": "S", "zombie": False, "exiting": False, "kthread": False,
            "starttime": pid, "nspid": [pid], "ns_init": False, "tag": None, "uid": 0}


def test_a_shell_wrapper_is_not_the_rank_its_child_is() -> None:
    """torchrun --no-python sh -c '... python train.py': the shell carries RANK, the trainer it
    runs carries it too, and the trainer's forked DataLoader worker as well."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "wrapped"}
    trainer = ["python3", "train.py"]
    processes = {
        10: _record(10, 1, ["python3", "-m", "torch.distributed.run", "sh", "-c", "x"], {}),
        11: _record(11, 10, ["sh", "-c", "exec-less wrapper"], env),
        12: _record(12, 11, trainer, env),
        13: _record(13, 12, trainer, env),
        14: _record(14, 13, trainer, env),  # a worker's own fork: still the trainer's helper
    }
    jobs = census_module()._jobs(processes, {}, [], "/nonexistent", "host")
    assert len(jobs) == 1
    assert [(r["rank"], r["pid"], r["helpers"]) for r in jobs[0]["ranks"]] == [(0, 12, [13, 14])]
    assert jobs[0]["launcher_pid"] == 10


def test_a_slurm_batch_shell_and_srun_are_not_ranks_the_tasks_are() -> None:
    """sbatch runs its script as task 0 of the batch step (SLURM_PROCID=0, MASTER_PORT
    exported), and srun inherits that: neither is a rank. The tasks srun starts under their
    step's slurmstepd are, numbered by SLURM_PROCID, with that slurmstepd as launcher; a
    wrapper shell a task runs is no rank either, its trainer child is."""
    base = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "SLURM_NTASKS": "2"}
    task = ["python3", "train.py"]
    processes = {
        20: _record(20, 1, ["slurmstepd: [7.batch]"], {}),
        21: _record(21, 20, ["bash", "/var/spool/slurmd/job7/slurm_script"],
                    dict(base, SLURM_PROCID="0", SLURM_LOCALID="0")),
        22: _record(22, 21, ["srun", "python3", "train.py"],
                    dict(base, SLURM_PROCID="0", SLURM_LOCALID="0")),
        30: _record(30, 1, ["slurmstepd: [7.0]"], {}),
        31: _record(31, 30, task, dict(base, SLURM_PROCID="0", SLURM_LOCALID="0")),
        32: _record(32, 30, ["bash", "-c", "python3 train.py"],
                    dict(base, SLURM_PROCID="1", SLURM_LOCALID="1")),
        33: _record(33, 32, task, dict(base, SLURM_PROCID="1", SLURM_LOCALID="1")),
    }
    for pid in (20, 30):
        processes[pid]["comm"] = "slurmstepd"
    [job] = census_module()._jobs(processes, {}, [], "/nonexistent", "host")
    assert [(r["rank"], r["pid"], r["rank_source"]) for r in job["ranks"]] == [
        (0, 31, "SLURM_PROCID"), (1, 33, "SLURM_PROCID")], job["ranks"]
    assert job["world_size"] == 2 and job["id"] == "10.0.0.1:29500"
    # the step's slurmstepd started both, one through a wrapper shell: it is the launcher
    assert (job["launcher"], job["launcher_pid"], job["max_restarts"]) == ("slurmstepd", 30, 0)


def test_a_lightning_job_is_found_with_its_main_process_as_rank_0(tmp_path: Path,
                                                                  jobs: list[Job]) -> None:
    pytest.importorskip("lightning")
    job = start_lightning(tmp_path)
    jobs.append(job)
    wait_spawn_steps(job, 3)
    found = census_job(tag=job.tag)
    main = job.processes[0].pid
    assert found["world_size"] == 2 and found["id"].startswith("127.0.0.1:"), found
    assert [(r["rank"], r["rank_source"]) for r in found["ranks"]] == [
        (0, "store host"), (1, "LOCAL_RANK on node 0")], found["ranks"]
    assert found["ranks"][0]["pid"] == main
    assert found["ranks"][1]["pid"] in children(main)
    assert all(len(r["helpers"]) == 1 for r in found["ranks"]), found["ranks"]  # DataLoader
    state = probes.job_state(tag=job.tag)
    assert state["verdict"] == "running", state["reason"]


def test_a_frozen_lightning_rank_hangs_the_job_then_a_kill_fails_it(tmp_path: Path,
                                                                    jobs: list[Job]) -> None:
    pytest.importorskip("lightning")
    job = start_lightning(tmp_path)
    jobs.append(job)
    wait_spawn_steps(job, 3)
    actions.freeze_rank(tag=job.tag, rank=1)
    found = probes.detect_hang(tag=job.tag, timeout_s=30)
    assert found["verdict"] == "hung", found["reason"]
    assert [c["rank"] for c in found["culprit_ranks"]] == [1], found["culprit_ranks"]
    assert found["blocked_in"]["ranks"] == [0], found["blocked_in"]
    actions.kill_rank(tag=job.tag, rank=1, wait_s=5)  # SIGKILL reaches a stopped process
    ended = probes.wait_job_verdict(tag=job.tag, verdicts=["failed"], timeout_s=60)
    assert ended["verdict"] == "failed", ended["reason"]
    assert sorted(r["rank"] for r in ended["ranks"]) == [0, 1], ended["ranks"]
    assert job.wait_exit(60)[0] not in (None, 0)


def test_a_killed_lightning_rank_whose_dataloader_worker_outlives_it(tmp_path: Path,
                                                                   jobs: list[Job]) -> None:
    """Rank 1 SIGKILLed while training: its forked DataLoader worker keeps the gloo connections
    it inherited open until it notices its parent is gone (PyTorch checks every 5 s), and
    Lightning ends the main process only when its own watch sees the dead child, so rank 0 may
    wait in its collective meanwhile: a real hang, whose culprit is the killed rank (and, while
    they hold its connections, its helpers). Then the job fails, and the worker left behind is
    never taken for a rank."""
    pytest.importorskip("lightning")
    job = start_lightning(tmp_path)
    jobs.append(job)
    wait_spawn_steps(job, 3)
    actions.kill_rank(tag=job.tag, rank=1, wait_s=0)
    ended = probes.wait_job_verdict(tag=job.tag, verdicts=["failed"], timeout_s=60)
    assert ended["verdict"] == "failed", ended["reason"]
    assert sorted(r["rank"] for r in ended["ranks"]) == [0, 1], ended["ranks"]
    for entry in ended["history"]:
        if entry["verdict"] == "hung":
            assert "rank 1 ended: killed by SIGKILL" in entry["reason"], entry["reason"]
    assert job.wait_exit(60)[0] not in (None, 0)


RECOVERY = REPO / "experiments" / "job-rank-freeze-recovery.json"


def test_the_freeze_recovery_game_day_on_a_lightning_job(tmp_path: Path, jobs: list[Job]) -> None:
    """`chaos run experiments/job-rank-freeze-recovery.json --var tag:str=...` against a job
    chaosgpu did not start: hung with the frozen rank as culprit, then running again, exit 0;
    the job is left running (the rollback only resumes)."""
    pytest.importorskip("lightning")
    (tmp_path / "job").mkdir()
    job = start_lightning(tmp_path / "job")
    jobs.append(job)
    wait_spawn_steps(job, 3)
    code, journal = run_experiment(RECOVERY, tmp_path, {"tag": job.tag})
    log = (tmp_path / "chaostoolkit.log").read_text()[-4000:]
    assert code == 0 and journal["status"] == "completed" and not journal["deviated"], log
    found = outputs(journal)["detect-hang"]["output"]
    assert found["verdict"] == "hung", found["reason"]
    assert [c["rank"] for c in found["culprit_ranks"]] == [1], found["culprit_ranks"]
    assert all(e["status"] == "succeeded" for e in journal["rollbacks"]), journal["rollbacks"]
    before = spawn_steps(job)
    wait_spawn_steps(job, max(before.values()) + 3)  # still training after the game-day
    assert all(p.poll() is None for p in job.processes)


def test_the_freeze_recovery_game_day_on_a_job_whose_ranks_show_no_number(
        tmp_path: Path, jobs: list[Job]) -> None:
    """The game-day, as written, on a file:// spawn job (no rank numbered anywhere): rank
    "any" freezes the newest rank, the hang names it by PID, the same process is resumed
    (the one this run froze) and the job trains on: exit 0."""
    (tmp_path / "job").mkdir()
    job = start_spawn(tmp_path / "job", rendezvous="file")
    jobs.append(job)
    wait_spawn_steps(job, 3)
    ranks = census_job(tag=job.tag)["ranks"]
    newest = max(r["pid"] for r in ranks)
    code, journal = run_experiment(RECOVERY, tmp_path, {"tag": job.tag})
    log = (tmp_path / "chaostoolkit.log").read_text()[-4000:]
    assert code == 0 and journal["status"] == "completed" and not journal["deviated"], log
    out = outputs(journal)
    assert out["freeze-rank"]["output"]["pid"] == newest, out["freeze-rank"]["output"]
    assert out["freeze-rank"]["output"]["rank"] is None
    found = out["detect-hang"]["output"]
    assert found["verdict"] == "hung", found["reason"]
    assert [c["pid"] for c in found["culprit_ranks"]] == [newest], found["culprit_ranks"]
    assert out["resume-rank"]["output"]["pid"] == newest
    assert all(e["status"] == "succeeded" for e in journal["rollbacks"]), journal["rollbacks"]
    before = spawn_steps(job)
    wait_spawn_steps(job, max(before.values()) + 3)  # still training after the game-day
    assert all(p.poll() is None for p in job.processes)


def test_resume_rank_any_resumes_only_what_this_run_froze(tmp_path: Path,
                                                          jobs: list[Job]) -> None:
    """rank="any" for resume_rank is the rank this run froze: a rank stopped by someone else
    stays stopped. With no rank frozen by this run at all (a run interrupted before its
    method) there is nothing to undo and the result says so; with ranks frozen by this run
    that are none of this job's live ones it fails and names what to do."""
    from chaosgpu import faultlog

    job = start_spawn(tmp_path, rendezvous="file")
    jobs.append(job)
    wait_spawn_steps(job, 3)
    other = census_job(tag=job.tag)["ranks"][0]["pid"]
    os.kill(other, signal.SIGSTOP)  # stopped by someone else (a debugger, say)
    # stopped before resume_rank looks: a rank still running when its stack is taken is read
    # by py-spy attached with ptrace, whose detach can swallow a SIGSTOP that came meanwhile
    # (seen once in CI: the rank ran on, though nothing resumed it)
    assert wait_until(lambda: proc_state(other) == "T")
    faultlog.clear()  # this run has frozen nothing yet
    try:
        nothing = actions.resume_rank(rank="any", tag=job.tag)
        assert nothing["result"] == "none frozen by this run" and nothing["pid"] is None
        assert proc_state(other) == "T"
        faultlog.record("SIGSTOP", pid=other + 10**6, starttime=1)  # another job's rank
        with pytest.raises(actions.JobError, match="was frozen by this run"):
            actions.resume_rank(rank="any", tag=job.tag)
        assert proc_state(other) == "T"
        frozen = actions.freeze_rank(rank="any", tag=job.tag)
        assert frozen["pid"] != other and frozen["rank"] is None, frozen
        resumed = actions.resume_rank(rank="any", tag=job.tag)
        assert resumed["pid"] == frozen["pid"] and proc_state(other) == "T", resumed
    finally:
        os.kill(other, signal.SIGCONT)
    with pytest.raises(ValueError, match='or "any"'):
        actions.freeze_rank(rank="some", tag=job.tag)


def test_a_rank_that_shows_no_number_is_partitioned_by_any_and_named_by_pid(
        tmp_path: Path, jobs: list[Job]) -> None:
    """partition_rank(rank="any") on a file:// job, whose ranks show no number: the newest
    rank is cut off, the hang names it by PID as partitioned, and healing resumes the job."""
    require_tool("nft", install="apt-get install nftables")
    if os.geteuid() != 0:
        pytest.skip("needs root to add nftables rules")
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    job = start_spawn(tmp_path, world_size=3, rendezvous="file")
    jobs.append(job)
    wait_spawn_steps(job, 3)
    # the last in the census's order: unnumbered ranks by PID, spawned in turn (start times
    # can share a clock tick)
    newest = max(census_job(tag=job.tag)["ranks"], key=lambda r: (r["starttime"], r["pid"]))
    cut = network.partition_rank(rank="any", tag=job.tag)
    try:
        assert (cut["rank"], cut["pid"]) == (None, newest["pid"]), cut
        assert cut["connections"], cut
        hung = probes.detect_hang(tag=job.tag, timeout_s=30)
        assert hung["verdict"] == "hung", hung["reason"]
        (culprit,) = hung["culprit_ranks"]
        assert culprit["pid"] == cut["pid"] and culprit["why"].startswith("partitioned"), hung
        assert f"rank ? (PID {cut['pid']})" in hung["reason"]
    finally:
        healed = network.heal_partition(partition=cut["partition"])
    assert healed["removed"] is True and partitions.active() == []
    back = probes.wait_job_verdict(["running"], tag=job.tag, timeout_s=60)
    assert back["reached"], back["reason"]


def test_the_freeze_recovery_game_day_refuses_a_job_that_is_not_there(tmp_path: Path) -> None:
    """A typo'd tag fails the run before anything is touched (exit 1, no fault injected)."""
    code, journal = run_experiment(RECOVERY, tmp_path, {"tag": "no-such-tag",
                                                        "recover_timeout_s": 5})
    assert code == 1, journal["status"]
    assert not any(e["activity"]["name"] == "freeze-rank" for e in journal.get("run", []))


def test_the_freeze_recovery_game_day_fails_when_no_hang_is_confirmed(tmp_path: Path,
                                                                      jobs: list[Job]) -> None:
    """A game-day whose fault was never seen to hang the job proves nothing: with no time to
    confirm the hang (hang_timeout_s 0), detect-hang fails (expect_hang) and the run is
    interrupted (exit 1, not completed); the rollback still resumes the rank and the job
    trains on."""
    job = start_torchrun(tmp_path, [])
    jobs.append(job)
    job.wait_steps(3)
    code, journal = run_experiment(RECOVERY, tmp_path, {"job": job.run_id,
                                                        "hang_timeout_s": 0})
    assert code == 1 and journal["status"] == "interrupted", journal["status"]
    found = outputs(journal)["detect-hang"]
    assert found["status"] == "failed"
    assert "no hang was confirmed" in "".join(found.get("exception") or []), found
    assert all(e["status"] == "succeeded" for e in journal["rollbacks"]), journal["rollbacks"]
    before = max(p["step"] for p in job.progress().values())
    job.wait_steps(before + 3, timeout_s=60)  # it trains on after the rollback


def test_a_timeline_scoped_to_a_job_tracks_the_ranks_the_census_finds(tmp_path: Path,
                                                                    jobs: list[Job]) -> None:
    """A timeline scoped to a job tracks the job's ranks as the census finds them, however it
    was launched: here the tutorial's shape (each rank sets MASTER_PORT in os.environ: found by
    its store's connections, seconds after the ranks' processes started, so after the timeline
    had examined them), and not their DataLoader workers."""
    from chaosgpu.timeline.sampler import Sampler

    job = start_spawn(tmp_path, rendezvous="rank-env")
    jobs.append(job)
    sampler = Sampler(rate_hz=20, source="host-rss", scope={"job": job.run_id}, rescan_s=0.2)
    sampler.start()
    try:
        wait_spawn_steps(job, 3)
        ranks = {r["pid"] for r in census_job(job.run_id)["ranks"]}
        deadline = time.monotonic() + 20
        while set(sampler.processes) != ranks and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(sampler.processes) == ranks, (sampler.processes.keys(), ranks)
    finally:
        sampler.stop()
    assert sampler.errors == []
