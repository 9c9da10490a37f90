"""The `ring` reference workload: a distributed job doing all_reduce in a loop.

This module owns the launcher (bare ranks started directly with RANK/WORLD_SIZE/MASTER_* env,
like the report's exec'd ranks, or the real `torchrun`) and the rank program itself (backend
nccl with one GPU per rank, or gloo on CPU, optionally holding GPU or host memory; a process-group
timeout; TORCH_NCCL_ASYNC_ERROR_HANDLING; an optional SIGTERM handler that destroys the process
group). Each rank writes `<ready-dir>/rank<R>.progress` ({"iteration", "t"}) every 0.25 s while
it makes progress, and `<ready-dir>/rank<R>.json` once its first all_reduce succeeded and its
first progress record is written (ready implies a step on record). It must
not signal processes it did not start and must not read /proc.

A rank whose all_reduce fails (a peer died, the timeout elapsed) prints the error and exits 1. A
rank whose all_reduce is still not complete 2 s after the timeout (NCCL without async error
handling) exits 4 on its own, unless `--timeout-s 0` asked for torch's default timeout and no
enforcement of ours (the report's "hung forever" variant).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from chaosgpu.arguments import (
    COUNT,
    INDEX,
    LISTEN_PORT,
    LONGEST_WAIT_S,
    NAME,
    POSITIVE,
    SECONDS,
    TAG,
    Rule,
    one_of,
    option,
)
from chaosgpu.errors import InvalidArgument
from chaosgpu.process.environment import helper_env
from chaosgpu.workloads.readiness import wait_all_ready, write_ready

__all__ = [
    "RingConfig",
    "RingLaunch",
    "build_parser",
    "free_port",
    "launch_ring",
    "main",
    "rank_env",
    "rank_main",
    "resolve_backend",
]

MIB = 1024 * 1024
OWN_TIMEOUT_MARGIN_S = 2.0
#: the longest process-group timeout: torch keeps it in milliseconds
LONGEST_TIMEOUT_S = LONGEST_WAIT_S
PROGRESS_EVERY_S = 0.25
#: A ring's choices, each with its rule (chaosgpu.arguments.one_of): RingConfig.validate, the
#: command line's options and start_ring (before anything starts, and in `chaosgpu validate`)
#: take these values and no other.
BACKENDS = ("nccl", "gloo", "auto")
LAUNCHERS = ("bare", "torchrun")
#: TORCH_NCCL_ASYNC_ERROR_HANDLING's levels (integers)
ASYNC_ERROR_HANDLINGS = (0, 1, 2, 3)
SIGTERM_HANDLERS = ("none", "destroy")
ON_OOMS = ("fail", "skip")
RING_BACKEND = one_of(BACKENDS)
LAUNCHER = one_of(LAUNCHERS)
ASYNC_ERROR_HANDLING = one_of(ASYNC_ERROR_HANDLINGS)
SIGTERM_HANDLER = one_of(SIGTERM_HANDLERS)
ON_OOM = one_of(ON_OOMS)
# Environment every rank gets: NVLink multicast off (see the project notes), quiet threads.
RANK_ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass
class RingConfig:
    """What a ring is: everything the launcher passes to its ranks."""

    backend: str = "auto"
    world_size: int = 2
    launcher: str = "bare"
    timeout_s: float = 60.0
    async_error_handling: int = 3
    sigterm_handler: str = "none"
    mib: int = 0
    iters_per_s: float = 10.0
    matmul: int = 0
    step_mib: int = 0
    on_oom: str = "fail"
    ready_dir: str | None = None
    tag: str | None = None
    job_id: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    log_dir: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """ValueError (InvalidArgument for the choices, numbers, the tag and the job id) naming
        the first field that is not valid (nan and inf included)."""
        RING_BACKEND.require("backend", self.backend)
        LAUNCHER.require("launcher", self.launcher)
        numbers: tuple[tuple[str, Rule, Any], ...] = (
            ("world size", COUNT, self.world_size), ("timeout", SECONDS, self.timeout_s),
            ("mib", INDEX, self.mib), ("iters per second", POSITIVE, self.iters_per_s),
            ("matmul", INDEX, self.matmul), ("step_mib", INDEX, self.step_mib),
            ("master port", LISTEN_PORT, self.master_port))
        for name, rule, value in numbers:
            rule.require(name, value)  # InvalidArgument, a ValueError
        # What the ranks carry is matched exactly by every selection: never a tag or job id
        # that no selection could name ("x " or "x\n").
        for name, rule, text in (("tag", TAG, self.tag), ("job id", NAME, self.job_id)):
            if text is not None:
                rule.require(name, text)
        if self.timeout_s > LONGEST_TIMEOUT_S:
            raise ValueError(f"timeout must be at most {LONGEST_TIMEOUT_S:g} s, "
                             f"got {self.timeout_s:g}")
        ASYNC_ERROR_HANDLING.require("async error handling", self.async_error_handling)
        SIGTERM_HANDLER.require("SIGTERM handler", self.sigterm_handler)
        ON_OOM.require("on_oom", self.on_oom)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def resolve_backend(backend: str, world_size: int) -> str:
    """`auto` becomes nccl when there are at least `world_size` GPUs, gloo otherwise; `nccl`
    with fewer GPUs than `world_size` (NCCL runs one rank per GPU and refuses two on one) is
    InvalidArgument naming the backend, the world size and the GPUs seen, before any rank
    starts. Both count the GPUs the same way (cuda_driver.gpu_count: NVML, else the CUDA
    driver API)."""
    if backend not in ("auto", "nccl"):
        return backend
    from chaosgpu.workloads.cuda_driver import gpu_count

    gpus = gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if gpus < world_size:
        seen = "no GPU is visible here" if gpus == 0 else f"only {gpus} GPU(s) are visible here"
        raise InvalidArgument(
            f"backend 'nccl' needs one GPU per rank (world_size {world_size}), and {seen} "
            "(NVML, else the CUDA driver API): no rank was started; use backend 'gloo', or "
            "'auto' (nccl where there are enough GPUs, else gloo)")
    return backend


def rank_env(config: RingConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment shared by every rank of `config` (before RANK/LOCAL_RANK): `base`
    (default: the launcher's own without its scope variables, chaosgpu.process.environment),
    plus the ring's own CHAOSGPU_JOB and CHAOSGPU_TAG where `config` sets them. A rank never
    carries the launcher's tag, job or sandbox: a kill by the runner's tag must not reach it."""
    env = dict(helper_env() if base is None else base)
    env.update(RANK_ENV_DEFAULTS)
    env["MASTER_ADDR"] = config.master_addr
    env["MASTER_PORT"] = str(config.master_port)
    env["WORLD_SIZE"] = str(config.world_size)
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = str(config.async_error_handling)
    env.setdefault("OMP_NUM_THREADS", "1")
    if config.master_addr in ("127.0.0.1", "localhost"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if config.job_id:
        env["CHAOSGPU_JOB"] = config.job_id
    if config.tag:
        env["CHAOSGPU_TAG"] = config.tag
    env.update(config.extra_env)
    return env


def _rank_args(config: RingConfig) -> list[str]:
    args = [
        "--backend", config.backend,
        "--timeout-s", f"{config.timeout_s:g}",
        "--sigterm-handler", config.sigterm_handler,
        "--mib", str(config.mib),
        "--iters-per-s", f"{config.iters_per_s:g}",
        "--launcher", config.launcher,
    ]  # fmt: skip
    if config.matmul or config.step_mib or config.on_oom != "fail":
        args += ["--matmul", str(config.matmul), "--step-mib", str(config.step_mib),
                 "--on-oom", config.on_oom]
    if config.ready_dir:
        args += ["--ready-dir", config.ready_dir]
    return args


@dataclass
class RingLaunch:
    """What the launcher started: the host PIDs (ranks for bare, the agent for torchrun)."""

    job_id: str
    backend: str
    launcher: str
    world_size: int
    master_addr: str
    master_port: int
    ready_dir: str | None
    pids: list[int]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "processes"}

    def ready_files(self) -> list[str]:
        if not self.ready_dir:
            return []
        return [os.path.join(self.ready_dir, f"rank{r}.json") for r in range(self.world_size)]

    def wait_ready(self, timeout_s: float) -> list[dict[str, Any]]:
        """Wait (under one deadline) until every rank wrote its readiness file."""
        if not self.ready_dir:
            raise ValueError("this ring has no ready dir: nothing to wait on")
        pids: list[int | None] = (
            list(self.pids) if self.launcher == "bare" else [None] * self.world_size
        )
        return wait_all_ready(self.ready_files(), timeout_s, pids=pids)


def launch_ring(
    config: RingConfig, detach: bool = False, python: str | None = None
) -> RingLaunch:
    """Start the ranks of `config`; `detach` puts them in their own session with DEVNULL stdin.

    Returns a RingLaunch; with `detach=False` the caller waits on `launch.processes`.
    """
    config.validate()
    backend = resolve_backend(config.backend, config.world_size)
    config.backend = backend
    if not config.job_id:
        config.job_id = f"ring-{uuid.uuid4().hex[:8]}"
    if not config.master_port:
        config.master_port = free_port(config.master_addr)
    if config.ready_dir:
        # absolute in the ranks' command line: a probe finding a detached ring by its tag reads
        # the step counters from there, whatever its own working directory
        config.ready_dir = os.path.abspath(config.ready_dir)
        os.makedirs(config.ready_dir, exist_ok=True)
    exe = python or sys.executable
    env = rank_env(config)
    processes: list[subprocess.Popen[bytes]] = []
    popen_kw: dict[str, Any] = {"start_new_session": detach}
    if detach:
        popen_kw["stdin"] = subprocess.DEVNULL
    if config.launcher == "bare":
        for rank in range(config.world_size):
            rank_environ = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            rank_environ["LOCAL_WORLD_SIZE"] = str(config.world_size)
            argv = [exe, "-m", "chaosgpu.workloads", "rank", *_rank_args(config)]
            processes.append(
                subprocess.Popen(
                    argv, env=rank_environ, **popen_kw, **_stdio(config, f"rank{rank}", detach)
                )
            )
    else:
        argv = [
            exe, "-m", "torch.distributed.run",
            "--nnodes", "1",
            "--nproc-per-node", str(config.world_size),
            "--master-addr", config.master_addr,
            "--master-port", str(config.master_port),
            "--rdzv-id", config.job_id,
            "--max-restarts", "0",
            "--monitor-interval", "0.1",
            "-m", "chaosgpu.workloads", "rank", *_rank_args(config),
        ]  # fmt: skip
        processes.append(
            subprocess.Popen(argv, env=env, **popen_kw, **_stdio(config, "torchrun", detach))
        )
    return RingLaunch(
        job_id=config.job_id,
        backend=backend,
        launcher=config.launcher,
        world_size=config.world_size,
        master_addr=config.master_addr,
        master_port=config.master_port,
        ready_dir=config.ready_dir,
        pids=[p.pid for p in processes],
        processes=processes,
    )


def _stdio(config: RingConfig, name: str, detach: bool) -> dict[str, Any]:
    if config.log_dir:
        os.makedirs(config.log_dir, exist_ok=True)
        log = open(os.path.join(config.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        return {"stdout": log, "stderr": subprocess.STDOUT}
    if detach:
        return {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    return {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chaosgpu workload ring",
        description="Run a ring of ranks doing all_reduce in a loop (bare processes or torchrun).",
    )
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--world-size", type=option(COUNT, int), default=2)
    parser.add_argument("--launcher", choices=LAUNCHERS, default="bare")
    parser.add_argument(
        "--timeout-s", type=option(SECONDS), default=60.0,
        help="process-group timeout in seconds (0: torch's default and no enforcement of ours)",
    )  # fmt: skip
    parser.add_argument("--async-error-handling", type=int, choices=ASYNC_ERROR_HANDLINGS,
                        default=3)
    parser.add_argument("--sigterm-handler", choices=SIGTERM_HANDLERS, default="none")
    parser.add_argument(
        "--mib", type=option(INDEX, int), default=0,
        help="MiB each rank holds (GPU when there is one, host memory otherwise)",
    )  # fmt: skip
    parser.add_argument("--iters-per-s", type=option(POSITIVE), default=10.0)
    _add_step_options(parser)
    parser.add_argument("--ready-dir", help="each rank writes rank<R>.json here once running")
    parser.add_argument("--tag", type=option(TAG, str), help="CHAOSGPU_TAG for every rank")
    parser.add_argument("--job-id", type=option(NAME, str),
                        help="CHAOSGPU_JOB for every rank (default: generated)")
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=option(LISTEN_PORT, int), default=0,
                        help="default (0): a free port")
    parser.add_argument("--log-dir", help="write each rank's (or torchrun's) output here")
    parser.add_argument(
        "--detach", action="store_true",
        help="start the ranks in their own sessions, print JSON with their pids and exit",
    )  # fmt: skip
    parser.add_argument(
        "--wait-ready-s", type=option(SECONDS), default=0.0,
        help="with --detach and --ready-dir: wait up to S seconds for every rank to be ready",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    """Launch a ring; wait on it (exit code: 0 when every process exited 0) or detach."""
    args = build_parser().parse_args(argv)
    config = RingConfig(
        backend=args.backend,
        world_size=args.world_size,
        launcher=args.launcher,
        timeout_s=args.timeout_s,
        async_error_handling=args.async_error_handling,
        sigterm_handler=args.sigterm_handler,
        mib=args.mib,
        iters_per_s=args.iters_per_s,
        matmul=args.matmul,
        step_mib=args.step_mib,
        on_oom=args.on_oom,
        ready_dir=args.ready_dir,
        tag=args.tag,
        job_id=args.job_id,
        master_addr=args.master_addr,
        master_port=args.master_port,
        log_dir=args.log_dir,
    )
    try:
        launch = launch_ring(config, detach=args.detach)
    except ValueError as error:
        print(f"ring: {error}", file=sys.stderr)
        return 2
    if args.detach:
        document = launch.to_json()
        if args.wait_ready_s > 0 and launch.ready_dir:
            try:
                document["ready"] = launch.wait_ready(args.wait_ready_s)
            except (TimeoutError, RuntimeError) as error:
                document["error"] = str(error)
                print(json.dumps(document))
                return 1
        print(json.dumps(document))
        return 0

    def _forward(signum: int, frame: Any) -> None:
        for process in launch.processes:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    codes = [process.wait() for process in launch.processes]
    return 0 if all(code == 0 for code in codes) else 1


# ---------------------------------------------------------------- the rank program


def _add_step_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--matmul", type=option(INDEX, int), default=0,
                        help="each iteration also multiplies two NxN matrices on the rank's "
                             "device and waits for the result (GPU work a GPU fault can slow or "
                             "block)")
    parser.add_argument("--step-mib", type=option(INDEX, int), default=0,
                        help="each iteration allocates a fresh tensor of this many MiB on the "
                             "rank's device and empties torch's cache afterwards (a job whose "
                             "memory need varies, which memory pressure can hit)")
    parser.add_argument("--on-oom", choices=ON_OOMS, default="fail",
                        help="on CUDA out-of-memory in a step: fail (exit 1) or skip the step "
                             "and go on (a job that handles OOM)")


def _rank_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chaosgpu.workloads rank")
    parser.add_argument("--backend", choices=BACKENDS, default="gloo")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--sigterm-handler", choices=SIGTERM_HANDLERS, default="none")
    parser.add_argument("--mib", type=int, default=0)
    parser.add_argument("--iters-per-s", type=float, default=10.0)
    _add_step_options(parser)
    parser.add_argument("--ready-dir")
    parser.add_argument("--launcher", default="bare")
    return parser


def _fail(rank: int, message: str, code: int = 1) -> None:
    print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
    os._exit(code)


def _placement(torch: Any, backend: str, rank: int, local_rank: int, world_size: int,
               wants_gpu: bool) -> tuple[str, Any, int | None]:
    """(backend, the collective's device, the GPU index for the rank's own work or None)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl":
        if gpus < 1:
            _fail(rank, "backend nccl needs a GPU and torch sees none", 3)
        device_index = local_rank % gpus
        torch.cuda.set_device(device_index)
        return backend, torch.device("cuda", device_index), device_index
    return backend, torch.device("cpu"), (local_rank % gpus if wants_gpu and gpus > 0 else None)


def _hold(torch: Any, mib: int, device_index: int | None) -> tuple[Any, str]:
    """Hold `mib` MiB, touched, on the GPU when there is one for the rank, else in host RAM."""
    if mib <= 0:
        return None, "none"
    if device_index is not None:
        held = torch.empty(mib * MIB, dtype=torch.uint8, device=f"cuda:{device_index}")
        held.fill_(1)
        torch.cuda.synchronize(device_index)
        return held, "torch"
    host = bytearray(mib * MIB)
    for offset in range(0, len(host), 4096):
        host[offset] = 1
    return host, "host"


def _own_work(torch: Any, device: Any, args: argparse.Namespace, operands: tuple[Any, Any],
              rank: int, iteration: int, ooms: int) -> int:
    """The step's own work (see _step); a CUDA OOM is counted (or fatal with --on-oom fail)."""
    oom_errors = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    try:
        _step(torch, device, args, *operands)
    except oom_errors as error:
        ooms += 1
        print(f"rank {rank}: CUDA out of memory at iteration {iteration} "
              f"({ooms} so far): {str(error).splitlines()[0][:200]}",
              file=sys.stderr, flush=True)
        if args.on_oom == "fail":
            _fail(rank, "giving up after CUDA out of memory (--on-oom fail)")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return ooms


def _all_reduce(torch: Any, dist: Any, tensor: Any, device: Any, backend: str, rank: int,
                iteration: int, started: float, own_limit: float | None) -> None:
    """One all_reduce, polled (so a Python SIGTERM handler can run meanwhile), with the rank's
    own limit; any failure ends the rank."""
    try:
        work = dist.all_reduce(tensor, async_op=True)
        assert work is not None
        while not work.is_completed():
            if own_limit is not None and time.monotonic() - started > own_limit:
                _fail(rank, f"all_reduce {iteration} still pending after {own_limit:g} s", 4)
            time.sleep(0.002)
        work.wait()
        if backend == "nccl":
            torch.cuda.synchronize(device)
    except Exception as error:
        _fail(rank, f"all_reduce {iteration} failed: {type(error).__name__}: {error}")
    tensor.fill_(1.0)


def _ready_record(args: argparse.Namespace, rank: int, local_rank: int, world_size: int,
                  backend: str, via: str, device_index: int | None) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "backend": backend,
        "launcher": args.launcher,
        "job": os.environ.get("CHAOSGPU_JOB"),
        "tag": os.environ.get("CHAOSGPU_TAG"),
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
        "mib": args.mib,
        "via": via,
        "device": device_index,
        "timeout_s": args.timeout_s,
        "async_error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        "sigterm_handler": args.sigterm_handler,
        "t_ready": time.time(),
    }


def rank_main(argv: list[str] | None = None) -> int:
    """One rank: join the process group, hold memory, all_reduce until killed or failed."""
    args = _rank_parser().parse_args(argv)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    import torch
    import torch.distributed as dist

    wants_gpu = args.mib > 0 or args.matmul > 0 or args.step_mib > 0
    backend, device, device_index = _placement(torch, args.backend, rank, local_rank,
                                               world_size, wants_gpu)
    held, via = _hold(torch, args.mib, device_index)  # held (referenced) until the rank ends

    def _destroy(signum: int, frame: Any) -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            os._exit(0)

    if args.sigterm_handler == "destroy":
        signal.signal(signal.SIGTERM, _destroy)
    init_kw: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size}
    if args.timeout_s > 0:
        init_kw["timeout"] = timedelta(seconds=args.timeout_s)
    if backend == "nccl":
        init_kw["device_id"] = device
    try:
        dist.init_process_group(**init_kw)
    except Exception as error:
        _fail(rank, f"init_process_group failed: {error}")
    tensor = torch.ones(1024, device=device)
    step_device = torch.device("cuda", device_index) if device_index is not None else device
    operands: tuple[Any, Any] = (None, None)
    if args.matmul > 0:
        operands = (torch.rand(args.matmul, args.matmul, device=step_device),
                    torch.rand(args.matmul, args.matmul, device=step_device))
    ooms = 0
    period = 1.0 / args.iters_per_s
    own_limit = args.timeout_s + OWN_TIMEOUT_MARGIN_S if args.timeout_s > 0 else None
    iteration = 0
    last_progress = 0.0
    while True:
        started = time.monotonic()
        if args.matmul > 0 or args.step_mib > 0:
            ooms = _own_work(torch, step_device, args, operands, rank, iteration, ooms)
        _all_reduce(torch, dist, tensor, device, backend, rank, iteration, started, own_limit)
        iteration += 1
        if args.ready_dir and time.monotonic() - last_progress >= PROGRESS_EVERY_S:
            last_progress = time.monotonic()
            write_ready(
                os.path.join(args.ready_dir, f"rank{rank}.progress"),
                {"iteration": iteration, "t": time.time(), "pid": os.getpid(), "ooms": ooms},
            )
        if iteration == 1 and args.ready_dir:
            # after the first progress record: a rank reported ready has a step on record,
            # so a progress reading taken as soon as the ring is ready sees every rank
            write_ready(os.path.join(args.ready_dir, f"rank{rank}.json"),
                        _ready_record(args, rank, local_rank, world_size, backend, via,
                                      device_index))
        rest = period - (time.monotonic() - started)
        if rest > 0:
            time.sleep(rest)


def _step(torch: Any, device: Any, args: argparse.Namespace, left: Any, right: Any) -> None:
    """One step's own work: a matmul waited for, and/or a fresh allocation released after."""
    if left is not None:
        product = left @ right
        float(product[0, 0].item())
    if args.step_mib > 0:
        scratch = torch.empty(args.step_mib * MIB, dtype=torch.uint8, device=device)
        scratch.fill_(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        del scratch
        if device.type == "cuda":
            torch.cuda.empty_cache()
