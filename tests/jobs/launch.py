"""Start the test training job (tests/jobs/train.py) under torchrun or bare, for the verdict
tests, and remove it afterwards whatever happened (SIGCONT + SIGKILL to its process group and to
anything carrying its tag)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proc_helpers import tagged

TRAIN = Path(__file__).resolve().parent / "train.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Job:
    """A started job: its run id (torchrun) or master address (bare), tag, processes, folders."""

    run_id: str
    tag: str
    workdir: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    world_size: int = 2

    @property
    def progress_dir(self) -> Path:
        return self.workdir / "progress"

    def progress(self) -> dict[int, dict[str, Any]]:
        """The ranks' own account of their steps (ground truth for assertions)."""
        found = {}
        for rank in range(self.world_size):
            path = self.progress_dir / f"rank{rank}.json"
            try:
                found[rank] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return found

    def wait_steps(self, steps: int = 2, timeout_s: float = 120.0,
                   restart: str | None = None) -> dict[int, dict[str, Any]]:
        """Wait until every rank reported `steps` steps (of restart attempt `restart`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = self.progress()
            if len(seen) == self.world_size and all(
                    p["step"] >= steps and (restart is None or p.get("restart") == restart)
                    for p in seen.values()):
                return seen
            if all(p.poll() is not None for p in self.processes):
                raise RuntimeError(f"the job ended before {steps} steps: {self.logs()}")
            time.sleep(0.1)
        raise TimeoutError(f"no {steps} steps within {timeout_s} s: {self.progress()} "
                           f"{self.logs()}")

    def logs(self) -> str:
        text = []
        for path in sorted(self.workdir.glob("*.log")):
            text.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(text)

    def wait_exit(self, timeout_s: float = 60.0) -> list[int | None]:
        """Wait for the launched processes to exit; their exit codes (None: still running)."""
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [proc.poll() for proc in self.processes]

    def stop(self) -> None:
        """Remove every process of the job (resume stopped ones first)."""
        for proc in self.processes:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except OSError:
                    pass
        for pid in tagged(self.tag):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        for proc in self.processes:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass


def _env(tag: str) -> dict[str, str]:
    env = dict(os.environ, CHAOSGPU_TAG=tag, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def start_torchrun(workdir: Path, args: list[str], nproc: int = 2, max_restarts: int = 0,
                   standalone: bool = False, extra_env: dict[str, str] | None = None,
                   launcher_args: list[str] | None = None) -> Job:
    """torchrun --nproc-per-node `nproc` [`launcher_args`] train.py `args` (c10d rendezvous on
    loopback, a known run id unless `standalone`)."""
    tag = f"verdict-{uuid.uuid4().hex[:8]}"
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    job = Job(run_id, tag, workdir, world_size=nproc)
    job.progress_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1"]
    if standalone:
        argv.append("--standalone")
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                 f"--rdzv-id={run_id}"]
    argv += [*(launcher_args or []), str(TRAIN), "--progress-dir", str(job.progress_dir), *args]
    env = _env(tag)
    env.update(extra_env or {})
    with open(workdir / "torchrun.log", "wb") as log:
        job.processes.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log,
                                              stdin=subprocess.DEVNULL,
                                              start_new_session=True))
    return job


def start_bare(workdir: Path, args: list[str], world_size: int = 2,
               netns: str | None = None) -> Job:
    """`world_size` plain processes (no launcher) with RANK/WORLD_SIZE/MASTER_* set; with
    `netns`, inside that named network namespace (`ip netns exec`)."""
    tag = f"verdict-{uuid.uuid4().hex[:8]}"
    port = free_port() if netns is None else 29500
    job = Job(f"127.0.0.1:{port}", tag, workdir, world_size=world_size)
    job.progress_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        env = _env(tag)
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with open(workdir / f"rank{rank}.log", "wb") as log:
            prefix = ["ip", "netns", "exec", netns] if netns else []
            job.processes.append(subprocess.Popen(
                [*prefix, sys.executable, str(TRAIN), "--progress-dir", str(job.progress_dir),
                 *args],
                env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                start_new_session=True))
    return job


def start_mpirun(workdir: Path, args: list[str], world_size: int = 2,
                 export_master: bool = True, flavour: str = "openmpi") -> Job:
    """`mpirun -np N python train.py` by an MPI launcher: Open MPI's `mpirun` (each rank gets
    OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK; `flavour="openmpi"`) or MPICH's Hydra
    (`mpiexec.hydra`, whose `hydra_pmi_proxy` starts the ranks with PMI_RANK/PMI_SIZE/
    MPI_LOCALRANKID; `flavour="mpich"`). Each rank copies them into RANK/WORLD_SIZE/LOCAL_RANK
    inside Python, so outside only the launcher's variables and MASTER_ADDR/MASTER_PORT
    (exported; with `export_master=False` set by each rank in os.environ instead: invisible)
    show. The job id is the master address."""
    if flavour not in ("openmpi", "mpich"):
        raise ValueError(f"flavour must be 'openmpi' or 'mpich', got {flavour!r}")
    tag = f"verdict-{uuid.uuid4().hex[:8]}"
    port = free_port()
    job = Job(f"127.0.0.1:{port}", tag, workdir, world_size=world_size)
    job.progress_dir.mkdir(parents=True, exist_ok=True)
    env = _env(tag)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    exported = ["CHAOSGPU_TAG", "PYTHONUNBUFFERED", "OMP_NUM_THREADS"]
    if export_master:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        exported += ["MASTER_ADDR", "MASTER_PORT"]
    else:
        args = [*args, "--master", f"127.0.0.1:{port}"]
    if flavour == "openmpi":
        launcher = ["mpirun", "-np", str(world_size), "--bind-to", "none",
                    *(arg for key in exported for arg in ("-x", key))]
    else:  # Hydra passes the whole environment by default
        launcher = ["mpiexec.hydra", "-n", str(world_size)]
    argv = [*launcher, sys.executable, str(TRAIN), "--progress-dir", str(job.progress_dir),
            *args]
    with open(workdir / f"{launcher[0]}.log", "wb") as log:
        job.processes.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log,
                                              stdin=subprocess.DEVNULL,
                                              start_new_session=True))
    return job


SPAWN_DDP = Path(__file__).resolve().parent / "spawn_ddp.py"


def start_spawn(workdir: Path, world_size: int = 2, loader_workers: int = 2,
                steps: int = 0, device: str = "cpu", rendezvous: str = "parent-env") -> Job:
    """The tutorial-shaped torch.multiprocessing.spawn DDP job (tests/jobs/spawn_ddp.py): no
    RANK in any environment, DataLoader worker processes under each rank; `rendezvous` says
    where the store's address is given (the main process's environment, each rank's os.environ
    as the tutorial does, a tcp:// init_method, or a file:// one in `workdir`). Its job id is
    the store's address (with a file:// rendezvous it is not known here: `run_id` is empty,
    select it by its tag); the tag is inherited from the main process's environment."""
    tag = f"verdict-{uuid.uuid4().hex[:8]}"
    port = free_port()
    job = Job(f"127.0.0.1:{port}" if rendezvous != "file" else "", tag, workdir,
              world_size=world_size)
    with open(workdir / "spawn.log", "wb") as log:
        job.processes.append(subprocess.Popen(
            [sys.executable, str(SPAWN_DDP), str(port), "--world-size", str(world_size),
             "--loader-workers", str(loader_workers), "--steps", str(steps),
             "--device", device, "--rendezvous", rendezvous,
             "--store-file", str(workdir / "spawn-ddp.store")],
            env=_env(tag), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            start_new_session=True))
    return job


def spawn_steps(job: Job) -> dict[int, int]:
    """The steps each rank of a spawn job printed ("rank R step N"), its own account."""
    steps: dict[int, int] = {}
    for line in (job.workdir / "spawn.log").read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "rank" and parts[2] == "step":
            steps[int(parts[1])] = max(steps.get(int(parts[1]), 0), int(parts[3]))
    return steps


def wait_spawn_steps(job: Job, steps: int = 3, timeout_s: float = 120.0) -> dict[int, int]:
    """Wait until every rank of a spawn job printed `steps` steps."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = spawn_steps(job)
        if len(seen) == job.world_size and min(seen.values()) >= steps:
            return seen
        if all(p.poll() is not None for p in job.processes):
            raise RuntimeError(f"the job ended before {steps} steps: {job.logs()}")
        time.sleep(0.1)
    raise TimeoutError(f"no {steps} steps within {timeout_s} s: {job.logs()}")


LIGHTNING_DDP = Path(__file__).resolve().parent / "lightning_ddp.py"


def start_lightning(workdir: Path, devices: int = 2) -> Job:
    """The Lightning DDP job (tests/jobs/lightning_ddp.py), started as a user starts it: no
    MASTER_* given (Lightning picks a port), so its job id is not known here: select it by its
    tag (`run_id` is empty). The ranks print "rank R step N" (spawn_steps reads them)."""
    tag = f"verdict-{uuid.uuid4().hex[:8]}"
    job = Job("", tag, workdir, world_size=devices)
    with open(workdir / "spawn.log", "wb") as log:
        job.processes.append(subprocess.Popen(
            [sys.executable, str(LIGHTNING_DDP), "--devices", str(devices)],
            env=_env(tag), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            start_new_session=True))
    return job
